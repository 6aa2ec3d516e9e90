"""Install hints that say what the README does: every pip install goes through constraints.txt
(an unpinned torch anywhere in a dependency tree would pull another build)."""

from __future__ import annotations

import shlex
from pathlib import Path

import mega.core


def pip_install(*arguments: str) -> str:
    """``pip install -c constraints.txt ARGUMENTS``."""
    return " ".join(("pip install -c constraints.txt", *arguments))


def repository_package(distribution: str, path: str) -> str:
    """How to install a package of the mega repository (``packages/models``...)."""
    return f"install {distribution} ({pip_install('-e', path)}, from the mega repository)"


def checkout_constraints() -> Path | None:
    """The constraints.txt of the mega checkout this mega runs from (an editable install), or None
    (mega installed from wheels: then there is no such file, and mega's own pins are what is installed)."""
    for directory in Path(mega.core.__file__).resolve().parents:
        if (directory / "constraints.txt").is_file() and (directory / "packages" / "core").is_dir():
            return directory / "constraints.txt"
    return None


def install_editable(directory: Path, extras: str = "test") -> str:
    """``pip install -c /abs/constraints.txt -e "/abs/DIR[extras]"``: absolute paths, so it works from
    any directory; without a checkout, no ``-c`` (what is installed already satisfies mega's pins)."""
    constraints = checkout_constraints()
    target = shlex.quote(f"{Path(directory).resolve()}[{extras}]")
    return " ".join(["pip install", *(["-c", shlex.quote(str(constraints))] if constraints else []), "-e", target])
