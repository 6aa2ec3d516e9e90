"""Deriving a family: the same model with other config defaults, under a name of its own.

    from mega.models import variant
    from mega.models.gpt import family as gpt

    FAMILY = variant(gpt.FAMILY, "gpt-relu", activation="relu", description="GPT with a ReLU MLP")

The variant's config class is a subclass whose fields default to the given values (so
``mega train --model-family gpt-relu`` trains a ReLU MLP and ``--activation gelu`` still overrides
it); every preset gets the same values; build, plans, loss and checkpoints are the family's own.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from mega.core.config.parser import chosen_values


def variant(family, name: str, description: str = "", **config_defaults: Any):
    """``family`` (a :class:`mega.core.model_family.ModelFamily`) named ``name``, its config
    fields defaulting to ``config_defaults`` (each a field of ``family.config_class``)."""
    base = family.config_class
    fields = {field.name: field for field in dataclasses.fields(base) if field.init}
    unknown = sorted(set(config_defaults) - set(fields))
    if unknown:
        raise TypeError(f"variant {name!r}: {base.__name__} has no field {', '.join(unknown)}")
    hints = typing.get_type_hints(base)
    config_class = dataclasses.make_dataclass(
        "".join(part.capitalize() for part in name.replace("_", "-").split("-")) + "Config",
        [(key, hints[key], dataclasses.field(default=value, metadata=fields[key].metadata))
         for key, value in config_defaults.items()],
        bases=(base,), frozen=base.__dataclass_params__.frozen,
    )
    config_class.__doc__ = f"{base.__name__} with {config_defaults} by default (the {name!r} family)."
    # Presets keep what they chose; what they only derived is derived again under the new defaults.
    presets = {preset: config_class(**{**chosen_values(config), **config_defaults})
               for preset, config in family.presets.items()}
    return dataclasses.replace(family, name=name, config_class=config_class, presets=presets,
                               description=description or f"{family.description} ({config_defaults})")
