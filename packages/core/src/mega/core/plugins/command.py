"""What a plugin registers to add a ``mega`` sub-command."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Command:
    """A ``mega`` sub-command.

    ``main`` is a callable ``main(argv: list[str]) -> int`` (the command parses its own
    arguments), or an import path to one, so the CLI imports a command's module, and whatever
    heavy library it needs, only when that command runs.
    """

    help: str
    main: Any
