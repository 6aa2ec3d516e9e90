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
from typing import Any

from mega.core.config.parser import chosen_values
from mega.models.family_defaults import with_defaults


def variant(family, name: str, description: str = "", **config_defaults: Any):
    """``family`` (a :class:`mega.core.model_family.ModelFamily`) named ``name``, its config
    fields defaulting to ``config_defaults`` (each a field of ``family.config_class``)."""
    class_name = "".join(part.capitalize() for part in name.replace("_", "-").split("-")) + "Config"
    config_class = with_defaults(family.config_class, class_name,
                                 f"{family.config_class.__name__} with {config_defaults} by default (the {name!r} family).",
                                 **config_defaults)
    # Presets keep what they chose; what they only derived is derived again under the new defaults.
    presets = {preset: config_class(**{**chosen_values(config), **config_defaults})
               for preset, config in family.presets.items()}
    return dataclasses.replace(family, name=name, config_class=config_class, presets=presets,
                               description=description or f"{family.description} ({config_defaults})")
