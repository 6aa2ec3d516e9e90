"""Sharded, reshardable, atomic checkpoints (``mega train --save/--load``, ``mega checkpoint info``).

See :mod:`mega.core.checkpoint.directory` for the on-disk layout and the atomicity rules,
:mod:`mega.core.checkpoint.state` for what a training checkpoint holds.

The tensor functions are imported on first use: they need torch.distributed.checkpoint, whose
import takes about a second, which a run that neither saves nor loads should not pay.
"""

from importlib import import_module

from mega.core.checkpoint.directory import (
    TRACKER_FILE,
    checkpoint_and_metadata,
    find_checkpoint,
    read_metadata,
    resolve_checkpoint,
)
from mega.core.checkpoint.metadata import CheckpointError, CheckpointMetadata
from mega.core.checkpoint.tokenizer_files import load_tokenizer, tokenizer_spec

_LAZY = {
    "LazyTensor": "mega.core.checkpoint.sharded_io",
    "load_model_weights": "mega.core.checkpoint.model_io",
    "read_tensors": "mega.core.checkpoint.model_io",
    "tensor_shapes": "mega.core.checkpoint.model_io",
    "write_checkpoint": "mega.core.checkpoint.model_io",
}

__all__ = [
    "TRACKER_FILE", "CheckpointError", "CheckpointMetadata", "LazyTensor", "checkpoint_and_metadata", "find_checkpoint",
    "load_model_weights", "load_tokenizer", "read_metadata", "read_tensors", "resolve_checkpoint",
    "tensor_shapes", "tokenizer_spec", "write_checkpoint",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
