"""Declaring a config field once: its default, its help and its command-line flag.

    hidden_size: int = option(768, "transformer hidden size")
    tp: int = option(1, "tensor-parallel size", flag="--tensor-model-parallel-size")

The flag defaults to the field name in Megatron's spelling (``--hidden-size``); the parser,
TOML loading and the flag reference are all generated from these declarations.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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


class Switch(argparse.Action):
    """A boolean flag with its opposite, for a default a model family may turn either way:
    Megatron's ``--disable-bias-linear`` (False) beside ``--add-bias-linear`` (True). Declared
    with ``option(..., action=switch("--add-bias-linear"))``."""

    def __init__(self, option_strings, dest, opposite: str, default=None, help=None, **_):
        super().__init__([*option_strings, opposite], dest, nargs=0, default=default,
                         help=f"{help} ({opposite}: the opposite)" if help else help)
        self.flag, self.opposite = option_strings[0], opposite

    def __call__(self, parser, namespace, values, option_string=None):
        # The declared flag sets what its name says (--disable-*: False, --untie-*: True).
        meaning = not self.flag.startswith(("--disable-", "--no-"))
        setattr(namespace, self.dest, meaning if option_string == self.flag else not meaning)


def switch(opposite: str):
    """The ``action`` of a boolean option whose flag has the opposite flag ``opposite``."""
    return functools.partial(Switch, opposite=opposite)
