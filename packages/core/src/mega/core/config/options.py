"""Declaring a config field once: its default, its help and its command-line flag.

    hidden_size: int = option(768, "transformer hidden size")
    tp: int = option(1, "tensor-parallel size", flag="--tensor-model-parallel-size")

The flag defaults to the field name in Megatron's spelling (``--hidden-size``); the parser,
TOML loading and the flag reference are all generated from these declarations.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def option(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None,
           choices: tuple | None = None, default_factory: Any = dataclasses.MISSING, action: Any = None) -> Any:
    metadata = {"help": help, "flag": flag, "choices": choices, "action": action}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def help_of(field: dataclasses.Field) -> str:
    return field.metadata.get("help", "")
