"""Checkpoints of LoRA runs: the adapters alone, loaded on a base (``--load BASE --load-adapter DIR``).

A model's adapters are the parameters marked ``checkpoint_optional`` (added after it was built);
a run that has them saves only them beside the optimizer (the frozen base is ``--load``'s). Loading
is in two parts: ``base`` (every parameter but the adapters, weights only) and ``adapters`` (only
them, with the optimizer and the run's progress).
What such a checkpoint's metadata says of its adapters and their base: adapter_record.py.
"""

from __future__ import annotations

from pathlib import Path

from mega.core.checkpoint.adapter_record import ADAPTER
from mega.core.checkpoint.metadata import CheckpointError
from mega.core.checkpoint.state import MODEL, Entries


def restrict_to_part(wanted: Entries, part: str | None, full_names: set[str], index: dict) -> tuple[set, dict]:
    """Keep in ``wanted`` the model entries of ``part``; returns the model names the checkpoint must
    hold and the part of its ``index`` to compare them with (a base's adapters, if it has any, and
    the base weights beside a LoRA run's adapters take no part)."""
    adapters = {key for key in wanted.optional if key.startswith(MODEL) and key[len(MODEL):] not in full_names}
    if part is not None:
        for key in [key for key in wanted.entries if key.startswith(MODEL)]:
            if (key in adapters) != (part == "adapters"):
                del wanted.entries[key], wanted.sources[key]
                wanted.optional.discard(key)
    if part == "adapters":
        return ({key[len(MODEL):] for key in adapters},
                {key: value for key, value in index.items() if not key.startswith(MODEL) or key in adapters})
    return full_names, {key: value for key, value in index.items() if key not in adapters}


def check_adapters_only(path: Path, index: dict, part: str | None, flag: str) -> None:
    """A checkpoint of adapters alone loads only with ``--load-adapter`` (its base from ``--load``)."""
    names = [key for key in index if key.startswith(MODEL)]
    adapters_only = bool(names) and all(ADAPTER in key for key in names)
    if adapters_only and part != "adapters":
        raise CheckpointError(f"{path} holds LoRA adapters alone: give the base model with --load and this "
                              f"checkpoint with --load-adapter")
    if part == "adapters" and not any(ADAPTER in key for key in names):
        raise CheckpointError(f"{flag} {path} holds no LoRA adapters")
