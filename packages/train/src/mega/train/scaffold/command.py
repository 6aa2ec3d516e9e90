"""``mega plugins new NAME --kind KIND``: a working plugin distribution to start from.

It writes ``pyproject.toml`` (the ``mega`` entry point), the module, a README and a test that runs
with pytest against the installed mega; installed as generated, its test passes
(tests/test_plugin_contract.py installs every kind and runs their tests).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from mega.core.cli.argparser import CommandParser
from mega.core.plugins.install_hint import install_editable
from mega.core.plugins.manager import get_plugins
from mega.train.scaffold.templates import KINDS, fill, template_files

NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


def files_for(name: str, kind: str) -> dict[str, str]:
    """``{relative path: text}`` of the distribution ``name`` of ``kind``."""
    template = KINDS[kind]
    module = name.replace("-", "_")
    values = {
        "name": name, "module": module, "dist": name, "kind": kind, "summary": template["summary"],
        "field": f"{module}_path", "flag": f"{name}-path",
        "dependencies": ", ".join(f'"{dependency}"' for dependency in template["dependencies"]),
    }
    values["summary"] = fill(template["summary"], values)  # "A `mega NAME` command"
    values["usage"] = fill(template["usage"], values)
    return {fill(path, values): fill(text, values) for path, text in template_files(kind).items()}


def write_plugin(name: str, kind: str, directory: Path) -> list[Path]:
    """Write the distribution into ``directory`` (new or empty); the paths written."""
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} exists and is not empty: choose another NAME or --output")
    written = []
    for relative, text in files_for(name, kind).items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


# The registry each kind registers into.
REGISTRY = {"family": "models", "callback": "callbacks", "command": "commands", "kernel": "kernel_backends",
            "tokenizer": "tokenizers", "checkpoint-format": "checkpoint_formats"}


def _taken(name: str, kind: str) -> str:
    """Who already registered ``name`` for ``kind`` in this installation ("" if nobody)."""
    registry = getattr(get_plugins(), REGISTRY[kind])
    if name not in registry:
        return ""
    entry = next(entry for entry in registry.entries() if entry.name == name)
    return f"{registry.kind} {name!r} is already registered by plugin {entry.plugin} ({entry.origin})"


def main(argv: list[str]) -> int:
    parser = CommandParser(
        prog="mega plugins new",
        description="Write a new plugin distribution (pyproject with the entry point, a module, a README and "
                    "a pytest test) that installs and passes as generated; docs/plugins.md walks through it.",
    )
    parser.add_argument("name", metavar="NAME", help="the registered name and the distribution's (lower-case, dashes)")
    parser.add_argument("--kind", required=True, choices=sorted(KINDS), help="what the plugin registers")
    parser.add_argument("--output", metavar="DIR", help="where to write it (default: ./NAME)")
    args = parser.parse_args(argv)
    if not NAME.match(args.name):
        parser.error(f"NAME {args.name!r} must be lower-case letters and digits joined by dashes (e.g. loss-csv)")
    taken = _taken(args.name, args.kind)
    if taken:
        parser.error(f"{taken}: a second registration would make the name unusable for both; choose another NAME")
    directory = Path(args.output or args.name)
    try:
        written = write_plugin(args.name, args.kind, directory)
    except FileExistsError as error:
        print(f"mega plugins new: error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print(f"\nnext: {install_editable(directory)} && pytest {shlex.quote(str(directory.resolve() / 'tests'))}")
    return 0
