"""The ``megatron`` checkpoint format: Megatron-LM save directories, legacy or torch_dist, read at
the layout they were saved at and written at the layout asked for (``WriteOptions``:
``megatron_format``, tensor/pipeline parallel sizes, the iteration)."""

from __future__ import annotations

from pathlib import Path

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.formats import WriteOptions
from mega.ckpt_convert.megatron.directory import LEGACY, TORCH_DIST, checkpoint, find
from mega.ckpt_convert.megatron.layout import model_layouts, refuse_legacy, refuse_split_stacks, stage_layers
from mega.ckpt_convert.megatron.names import names_for
from mega.ckpt_convert.megatron.param_order import ORDERS
from mega.ckpt_convert.megatron.read_legacy import LegacySource
from mega.ckpt_convert.megatron.read_torch_dist import TorchDistSource
from mega.ckpt_convert.megatron.source import MegatronSource
from mega.ckpt_convert.megatron.write_legacy import write_legacy
from mega.ckpt_convert.megatron.write_torch_dist import write_torch_dist
from mega.ckpt_convert.optimizer_state import optimizer_state_of
from mega.ckpt_convert.source import ModelSource, family_by_name, format_names

MEGATRON_FORMATS = (LEGACY, TORCH_DIST)


class MegatronFormat:
    name = "megatron"
    load_for_training = True  # mega train --load converts it on the fly (mega.core.checkpoint.foreign)

    def detect(self, path: Path) -> bool:
        return find(path) is not None

    def open(self, path: Path, model_family: str | None = None, allow_unused: bool = False) -> MegatronSource:
        """``allow_unused``: tensors the model of the args does not use are warned about, not refused."""
        found = checkpoint(path)
        if found.kind == LEGACY:
            return LegacySource(found, model_family, allow_unused)
        return TorchDistSource(found, model_family, allow_unused)

    def describe(self, path: Path) -> list[str]:
        """Lines for ``mega checkpoint info``."""
        with self.open(path) as source:
            return source.describe()

    def write(self, source: ModelSource, directory: Path, options: WriteOptions) -> list[str]:
        kind, tp, pp = options.megatron_format, options.tensor_parallel_size, options.pipeline_parallel_size
        family = family_by_name(source.family)
        _check_source(source, family, options)
        distributed = options.megatron_optimizer == "distributed"
        optimizer = optimizer_state_of(source, "the input") if options.with_optimizer else None
        iteration = options.iteration if options.iteration is not None else getattr(source, "iteration", None)
        if iteration is None and optimizer is not None:
            iteration = optimizer.iteration
        if kind == LEGACY:
            write_legacy(source, family, directory, tp, pp, iteration or None, optimizer)
        else:
            write_torch_dist(source, family, directory, tp, pp, iteration or None, optimizer, distributed)
        warnings = list(getattr(source, "warnings", []))
        if source.tokenizer is not None:
            warnings.append(f"the tokenizer ({source.tokenizer.type}) is recorded in the args by type and file paths "
                            "only; Megatron-LM checkpoints carry no tokenizer files")
        return warnings


def _check_source(source: ModelSource, family, options: WriteOptions) -> None:
    """What cannot be written, refused before anything is: the format and optimizer asked for, the
    layout, a source whose tensors are not its config's model."""
    kind, tp, pp = options.megatron_format, options.tensor_parallel_size, options.pipeline_parallel_size
    if kind not in MEGATRON_FORMATS:
        raise ConversionError(f"--megatron-format {kind!r}: choose {' or '.join(MEGATRON_FORMATS)}")
    config = source.config
    if kind == LEGACY:
        refuse_legacy(names_for(family.name), family.name, "--megatron-format torch")
        refuse_split_stacks(names_for(family.name), pp, f"--pipeline-model-parallel-size {pp}")
    stage_layers(config.num_layers, pp)  # the layers split evenly over the stages
    layouts = model_layouts(family, config, tp)
    if set(source.names()) != set(layouts):
        raise ConversionError(f"the {source.family} source does not match its model config: "
                              f"{format_names(set(source.names()) ^ set(layouts))}")
    for name, layout in layouts.items():
        shape = source.shape(name)
        fits = shape[1:] == layout.shape[1:] if layout.padded_vocab else shape == layout.shape
        if not fits or (layout.padded_vocab and shape[0] < config.vocab_size):
            raise ConversionError(f"the {source.family} source: {name} has shape {list(shape)}, but its "
                                  f"model config implies {list(layout.shape)}")
    if options.megatron_optimizer == "distributed" and (kind == LEGACY or not options.with_optimizer):
        raise ConversionError("the distributed optimizer's state is written into torch_dist checkpoints with "
                              "--with-optimizer (--megatron-format torch_dist)")
    if options.with_optimizer and kind == LEGACY and family.name not in ORDERS:
        raise ConversionError(f"--with-optimizer: mega writes optimizer state into legacy Megatron-LM files "
                              f"of {', '.join(sorted(ORDERS))} models, not {family.name}'s (its parameter "
                              "order in megatron-core is not mapped); use --megatron-format torch_dist")


MEGATRON_FORMAT = MegatronFormat()
