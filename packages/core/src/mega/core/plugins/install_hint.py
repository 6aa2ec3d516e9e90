"""Install hints that say what the README does: every pip install goes through constraints.txt
(an unpinned torch anywhere in a dependency tree would pull another build)."""

from __future__ import annotations


def pip_install(*arguments: str) -> str:
    """``pip install -c constraints.txt ARGUMENTS``."""
    return " ".join(("pip install -c constraints.txt", *arguments))


def repository_package(distribution: str, path: str) -> str:
    """How to install a package of the mega repository (``packages/models``...)."""
    return f"install {distribution} ({pip_install('-e', path)}, from the mega repository)"
