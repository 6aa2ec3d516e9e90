"""``ModelSource``: a model's weights under mega's names, handed over one global tensor at a time.

Every format reads a checkpoint into a source and writes a checkpoint from one, so a conversion
is ``target.write(source.open(path))`` and never holds more than the tensors of one layer.
Names are Megatron-Core's global parameter names (``decoder.layers.3.mlp.linear_fc1.weight``);
vocabulary tensors may have more rows than ``config.vocab_size`` (padding), which writers cut or
pad to what their layout wants.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Protocol

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.core.build import build_stage
from mega.core.checkpoint.state import named_parameters
from mega.core.parallel import ParallelConfig
from mega.core.parallel.param_attrs import is_padded_vocab
from mega.core.plugins import PluginError, get_plugins
from mega.core.tokenizer import TokenizerSpec


class ModelSource(Protocol):
    """What a format's ``open`` returns (and :func:`mega.ckpt_convert.open_checkpoint`).

    * ``family``: the registered model family's name; ``config``: its config instance.
    * ``tokenizer``: the tokenizer the model was trained with, file options as absolute paths.
    * ``tokenizer_extras``: further files that describe tokens and travel with the model
      (``tokenizer_config.json``, ``special_tokens_map.json``, ``generation_config.json``), by name.
    * ``get(name)`` reads and converts one tensor; call it once per name, in any order.

    A source may hold files open: ``close()`` it, or use it as a context manager.
    """

    family: str
    config: Any
    tokenizer: TokenizerSpec | None
    tokenizer_extras: dict[str, Path]

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def get(self, name: str) -> torch.Tensor: ...

    def close(self) -> None: ...

    def __enter__(self) -> ModelSource: ...

    def __exit__(self, *exc) -> None: ...


class ClosingSource:
    """The context-manager half of a source: ``with open_checkpoint(path) as source: ...``."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TableSource(ClosingSource, abc.ABC):
    """A source that lists its tensors in a table: ``_table()`` gives name -> (shape, dtype, ...)."""

    @abc.abstractmethod
    def _table(self) -> dict:
        """name -> (shape, dtype, ...) of every tensor the source holds."""

    def shape(self, name: str) -> tuple[int, ...]:
        return self._table()[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._table()[name][1]


class CastSource(ClosingSource):
    """A source whose floating-point tensors come as ``dtype`` (``mega convert --dtype``)."""

    def __init__(self, source: ModelSource, dtype: torch.dtype):
        self.source, self.target_dtype = source, dtype
        self.family, self.config = source.family, source.config
        self.tokenizer, self.tokenizer_extras = source.tokenizer, source.tokenizer_extras

    def names(self) -> list[str]:
        return self.source.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        dtype = self.source.dtype(name)
        return self.target_dtype if dtype.is_floating_point else dtype

    def get(self, name: str) -> torch.Tensor:
        return self.source.get(name).to(self.dtype(name))

    def close(self) -> None:
        self.source.close()

    def __getattr__(self, name: str):
        # optimizer_state / get_optimizer / iteration / origin pass through uncast: --dtype concerns the weights
        if name in ("optimizer_state", "get_optimizer", "iteration", "origin"):
            return getattr(self.source, name)
        raise AttributeError(name)


def model_parameters(family, config, tensor_parallel_size: int = 1,
                     trained_only: bool = False) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Name -> (global shape, whether dim 0 is the padded vocabulary) of every parameter of the
    whole model at ``tensor_parallel_size``, from a build on the meta device (nothing allocated);
    ``trained_only``: those the optimizer trains (a frozen one, DeepSeek's expert bias, has no state)."""
    try:
        config.validate(tensor_parallel_size)
    except ValueError as error:
        problem = "is not valid" if tensor_parallel_size == 1 else \
            f"cannot be split for tensor parallel size {tensor_parallel_size}"
        raise ConversionError(f"the {family.name} model {problem}: {error}") from None
    model = build_stage(family, config, parallel=ParallelConfig(tp=tensor_parallel_size), device="meta")
    named, _ = named_parameters([model])  # by canonical name, as checkpoints store them
    return {name: (tuple(param.shape), is_padded_vocab(param)) for name, param in named.items()
            if param.requires_grad or not trained_only}


def family_by_name(name: str):
    """The registered model family ``name``; an unknown one is a :class:`ConversionError`."""
    try:
        return get_plugins().models.get(name)
    except PluginError as error:
        raise ConversionError(str(error)) from None


def format_names(names, limit: int = 4) -> str:
    """A few names of a set for an error message, and how many more there are."""
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
