"""A config class whose fields default to a family's architecture.

A family is its architecture: ``--model-family llama`` alone is a LLaMA (RoPE, RMSNorm, SwiGLU,
no biases, untied), not the shared config's GPT. Its config class is the shared one with those
defaults (each field keeps its flag, help and place), so ``mega train --model-family llama
--help`` shows them, flags override them, and sizes keep the shared small defaults.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


def with_defaults(base: type, name: str, doc: str = "", module: str | None = None, **defaults: Any) -> type:
    """A subclass ``name`` of the config dataclass ``base`` whose fields ``defaults`` name
    default to the given values."""
    fields = {field.name: field for field in dataclasses.fields(base) if field.init}
    unknown = sorted(set(defaults) - set(fields))
    if unknown:
        raise TypeError(f"{name}: {base.__name__} has no field {', '.join(unknown)}")
    hints = typing.get_type_hints(base)
    config_class = dataclasses.make_dataclass(
        name, [(key, hints[key], dataclasses.field(default=value, metadata=_help_with_default(fields[key], value)))
               for key, value in defaults.items()],
        bases=(base,), frozen=base.__dataclass_params__.frozen,
    )
    config_class.__module__ = module or base.__module__  # where pickle and reprs find it
    config_class.__doc__ = doc or f"{base.__name__} with {defaults} by default."
    return config_class


def _help_with_default(field: dataclasses.Field, value: Any) -> dict:
    """The field's metadata; a boolean's help says which way this class defaults (argparse's
    help shows other defaults itself)."""
    metadata = dict(field.metadata)
    if isinstance(value, bool) and metadata.get("help"):
        metadata["help"] += f" [default here: {field.name}={value}]"
    return metadata
