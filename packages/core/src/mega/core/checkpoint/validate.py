"""Checks before a load touches anything: the checkpoint holds what this run needs, at shapes
that fit, so a mismatch is one clear error instead of a half-loaded model."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mega.core.checkpoint.metadata import CheckpointError
from mega.core.checkpoint.state import MODEL, OPTIMIZER, Entries


def name_examples(keys: set[str]) -> str:
    """The first few of ``keys`` (sorted), and how many more."""
    shown = sorted(keys)[:4]
    return ", ".join(shown) + (f" and {len(keys) - len(shown)} more" if len(keys) > len(shown) else "")


def check_model_names(path: Path, expected: set[str], index: dict[str, TensorStorageMetadata]) -> None:
    """The checkpoint's model tensors are exactly the full model's parameters ``expected``."""
    saved = {key[len(MODEL):] for key in index if key.startswith(MODEL)}
    missing, unexpected = expected - saved, saved - expected
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"lacks {name_examples(missing)}")
        if unexpected:
            problems.append(f"has {name_examples(unexpected)}, which this model does not")
        raise CheckpointError(f"{path} does not match this model: it {'; it '.join(problems)} "
                              "(is the model configuration the one it was saved with?)")


def check_entries(path: Path, wanted: Entries, index: dict[str, TensorStorageMetadata]) -> None:
    """Every wanted key is saved, at the wanted global shape (vocabulary rows may differ)."""
    missing = {key for key in wanted.entries if key not in index}
    if missing:
        hint = " (start without it: --no-load-optim)" if all(k.startswith(OPTIMIZER) for k in missing) else ""
        raise CheckpointError(f"{path} lacks {name_examples(missing)}{hint}")
    for key, entry in wanted.entries.items():
        saved, wanted_shape = tuple(index[key].size), entry.global_shape
        if saved == wanted_shape:
            continue
        padded_vocab = wanted.sources[key][1]
        if not (padded_vocab and saved[1:] == wanted_shape[1:]):
            raise CheckpointError(f"{path}: {key} has shape {list(saved)} in the checkpoint, "
                                  f"{list(wanted_shape)} in this model")


def zero_rows_beyond(wanted: Entries, index: dict[str, TensorStorageMetadata]) -> None:
    """Zero the padded-vocabulary rows the checkpoint does not have (it was padded less)."""
    with torch.no_grad():
        for key, entry in wanted.entries.items():
            saved_rows = index[key].size[0]
            if saved_rows >= entry.global_shape[0]:
                continue
            for piece in entry.pieces:
                first = max(saved_rows - piece.offsets[0], 0)
                if first < piece.data.shape[0]:
                    piece.data[first:].zero_()
