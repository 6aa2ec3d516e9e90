"""Checkpoint formats: what ``register_checkpoint_formats`` registers, and finding the right one.

A format reads a checkpoint into a :class:`~mega.ckpt_convert.source.ModelSource` and writes one
from any source::

    name: str
    detect(path) -> bool                      does ``path`` look like this format?
    open(path, model_family=None, allow_unused=False) -> ModelSource
                                              allow_unused: tensors the model does not use
                                              are a warning (in source.warnings), not an error
    write(source, directory, options) -> list[str]   warnings for the user

``write`` fills ``directory`` (created by the caller's conversion, which renames it into place
only when the write finished). Formats are plugins: ``hf`` and ``mega`` live in this package.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.source import ModelSource
from mega.core.plugins import PluginError, get_plugins
from mega.core.plugins.failures import failure_line

# transformers' save_pretrained shards at 5 GB by default (4.x); larger files load as well.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


@dataclass(frozen=True)
class WriteOptions:
    """How to lay the output out; each format reads the fields that concern it."""

    tensor_parallel_size: int = 1  # mega, megatron: the layout recorded and the vocabulary padding
    pipeline_parallel_size: int = 1  # mega, megatron
    expert_parallel_size: int = 1  # mega: the layout recorded (MoE families check their experts split evenly)
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES  # hf
    progress: bool | None = None  # None: on a terminal only
    megatron_format: str = "torch_dist"  # megatron: "legacy" (torch.save per rank) or "torch_dist"
    iteration: int | None = None  # megatron: the iteration recorded (default: the source's, else release)
    with_optimizer: bool = False  # mega, megatron torch_dist: carry the source's optimizer state and iteration
    # megatron torch_dist with_optimizer: the optimizer of the Megatron-LM run that loads it, "regular" or
    # "distributed" (--use-distributed-optimizer)
    megatron_optimizer: str = "regular"
    # hf: write the heads mega initialised when it read a directory that lacked them (a bare BertModel's
    # cls.*), making the full architecture; by default the export gives back the architecture that came in
    with_initialised_heads: bool = False


class CheckpointFormat(Protocol):
    name: str

    def detect(self, path: Path) -> bool: ...

    def open(self, path: Path, model_family: str | None = None, allow_unused: bool = False) -> ModelSource: ...

    def write(self, source: ModelSource, directory: Path, options: WriteOptions) -> list[str]: ...


def get_format(name: str, plugins=None) -> CheckpointFormat:
    try:
        return (plugins or get_plugins()).checkpoint_formats.get(name)
    except PluginError as error:
        raise ConversionError(str(error)) from None


def detect_format(path: Path, plugins=None) -> CheckpointFormat:
    registry = (plugins or get_plugins()).checkpoint_formats
    if not path.exists():
        raise ConversionError(f"{path} does not exist")
    for name in registry.names():
        checkpoint_format = get_format(name, plugins)
        if checkpoint_format.detect(path):
            return checkpoint_format
    failed = "".join(f"; {failure_line(info)} (it may provide the format)" for info in (plugins or get_plugins()).failed())
    raise ConversionError(f"{path} is not a checkpoint of a known format ({', '.join(registry.names())}); "
                          f"name it with --from{failed}")


def open_checkpoint(path: str | os.PathLike, model_family: str | None = None, plugins=None) -> ModelSource:
    """A model source for a checkpoint of any registered format (a Hugging Face directory, a
    mega save directory...), found by looking at ``path``; close it when done."""
    path = Path(path)
    return detect_format(path, plugins).open(path, model_family)
