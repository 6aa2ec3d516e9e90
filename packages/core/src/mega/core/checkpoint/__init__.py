"""Sharded, reshardable, atomic checkpoints (``mega train --save/--load``, ``mega checkpoint info``).

See :mod:`mega.core.checkpoint.directory` for the on-disk layout and the atomicity rules,
:mod:`mega.core.checkpoint.state` for what a training checkpoint holds.
"""

from mega.core.checkpoint.directory import TRACKER_FILE, find_checkpoint, read_metadata, resolve_checkpoint
from mega.core.checkpoint.metadata import CheckpointError, CheckpointMetadata
from mega.core.checkpoint.model_io import load_model_weights, read_tensors, tensor_shapes, write_checkpoint
from mega.core.checkpoint.sharded_io import LazyTensor
from mega.core.checkpoint.tokenizer_files import load_tokenizer, tokenizer_spec

__all__ = [
    "TRACKER_FILE", "CheckpointError", "CheckpointMetadata", "LazyTensor", "find_checkpoint",
    "load_model_weights", "load_tokenizer", "read_metadata", "read_tensors", "resolve_checkpoint",
    "tensor_shapes", "tokenizer_spec", "write_checkpoint",
]
