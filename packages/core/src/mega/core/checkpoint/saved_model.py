"""The model a checkpoint was saved from, as the starting point of a run that loads it.

``mega train --load CKPT`` (with ``--finetune``, ``--load-adapter`` or to resume) needs no
architecture flag: the checkpoint's model family, model config and tokenizer are where the run
starts, as a preset would be; flags and TOML values that are given change it. A change that
would compute another function with the checkpoint's weights is refused, naming the flag and
both values (:mod:`mega.core.checkpoint.config_check` says what may change; docs/finetuning.md
has the table). Megatron's ``--use-checkpoint-args`` asks for this; mega always does it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mega.core.checkpoint.config_check import model_config_differences
from mega.core.checkpoint.directory import find_checkpoint
from mega.core.checkpoint.foreign import foreign_format
from mega.core.checkpoint.tokenizer_files import tokenizer_spec
from mega.core.config import ConfigError
from mega.core.tokenizer import TokenizerSpec


@dataclass(frozen=True)
class SavedModel:
    path: Path  # the checkpoint directory (an iteration's, the one --load resumes)
    family: str
    config: dict[str, Any]  # the family config class's fields, as saved
    tokenizer: TokenizerSpec | None  # its files inside the checkpoint


def saved_model(load: str | None, plugins=None) -> SavedModel | None:
    """What the checkpoint ``--load`` names was saved from; None where there is nothing to take a
    model from: no ``--load``, a directory with no checkpoint yet (a run that will save there),
    or another format's checkpoint (converted on the fly, its model given by flags)."""
    if not load or foreign_format(load, plugins, capability="load_for_training") is not None:
        return None
    found = find_checkpoint(load, checksums=False)  # the load compares checksums later, once
    if found is None:
        return None
    path, metadata = found
    return SavedModel(path, metadata.model_family, metadata.model_config, tokenizer_spec(path, metadata))


def check_family(saved: SavedModel, family: str) -> None:
    if family != saved.family:
        raise ConfigError(f"--load {saved.path} holds a {saved.family!r} model; this run asks for {family!r} "
                              f"(--model-family): leave --model-family out to train the checkpoint's")


def check_run_model(saved: SavedModel, config: Any) -> None:
    """Refuse, before anything is built, a run whose flags change the loaded model's function."""
    differences = model_config_differences(saved.config, config)
    if differences:
        raise ConfigError(f"--load {saved.path} does not match this model: it was saved with "
                              + "; ".join(differences) + ". Leave these flags out (the checkpoint gives the "
                              "model) or give its values: others would compute another function with its weights")
