"""The ``mega`` checkpoint format: the sharded checkpoints of ``mega train --save``
(:mod:`mega.core.checkpoint`), read at any layout and written at the layout asked for.

The tensors are global (``torch.distributed.checkpoint`` pieces with global shapes), so a
layout changes only what the metadata records and how many vocabulary rows are padded:
resharding tp2 x pp2 to tp1 x pp1 is rewriting the same tensors with the new padding.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.formats import WriteOptions
from mega.ckpt_convert.hf_tokenizer import EXTRA_FILES
from mega.ckpt_convert.megatron.directory import find as find_megatron
from mega.ckpt_convert.optimizer_state import MAIN_PARAM, MOMENTS, OptimizerState, optimizer_state_of
from mega.ckpt_convert.progress import Progress
from mega.ckpt_convert.safetensors_io import tensor_nbytes
from mega.ckpt_convert.source import (
    ModelSource,
    TableSource,
    family_by_name,
    format_names,
    model_parameters,
)
from mega.core.checkpoint import (
    TRACKER_FILE,
    CheckpointError,
    CheckpointMetadata,
    LazyTensor,
    checkpoint_and_metadata,
    read_tensors,
    tensor_shapes,
    tokenizer_spec,
    write_checkpoint,
)
from mega.core.checkpoint.metadata import METADATA_FILE
from mega.core.checkpoint.sharded_io import ShardedEntry, load_entries, read_index
from mega.core.checkpoint.state import OPTIMIZER
from mega.core.checkpoint.tokenizer_files import TOKENIZER_DIR
from mega.core.parallel import ParallelConfig
from mega.core.parallel.pieces import Piece
from mega.core.pipeline.partition import PartitionError, split_layers
from mega.core.version import __version__


class MegaSource(TableSource):
    """A mega checkpoint as a model source; each read opens and closes its files."""

    def __init__(self, path: Path, model_family: str | None):
        self.directory, metadata = checkpoint_and_metadata(path)
        if model_family is not None and model_family != metadata.model_family:
            raise ConversionError(f"{self.directory} holds a {metadata.model_family!r} model, not --model-family "
                                  f"{model_family!r}")
        family = family_by_name(metadata.model_family)
        self.family = family.name
        try:
            self.config = family.config_class(**metadata.model_config)
        except (TypeError, ValueError) as error:
            raise ConversionError(f"{self.directory / METADATA_FILE}: model_config does not make a "
                                  f"{family.name} config: {error}") from None
        self.tokenizer = tokenizer_spec(self.directory, metadata)
        tokenizer_dir = self.directory / TOKENIZER_DIR
        self.tokenizer_extras = {name: tokenizer_dir / name for name in EXTRA_FILES if (tokenizer_dir / name).is_file()}
        self._tensors = tensor_shapes(self.directory)
        self._metadata = metadata
        self.origin = metadata.source  # what the checkpoint was converted from, if it was
        tp = metadata.layout.get("tp", 1)
        check_tensors(f"{self.directory}", {name: shape for name, (shape, _) in self._tensors.items()},
                      model_parameters(family, self.config, tp), self.config.vocab_size)

    def names(self) -> list[str]:
        return list(self._tensors)

    def _table(self) -> dict:
        return self._tensors

    def get(self, name: str) -> torch.Tensor:
        return read_tensors(self.directory, [name])[name]

    def optimizer_state(self) -> OptimizerState:
        saved = self._metadata.optimizer
        if saved is None:
            raise ConversionError(f"--with-optimizer: {self.directory} holds no optimizer state (a weights-only "
                                  "checkpoint, or saved before the optimizer's first step)")
        keys = set(saved["state_keys"])
        if "momentum_buffer" in keys:
            # Megatron-LM (megatron-core 0.16) keeps Muon's momentum in a chain of non-distributed
            # optimizers and refuses Muon with --use-distributed-optimizer: there is no Megatron
            # layout of it for us to write, and Adam's would mislabel it.
            raise ConversionError(
                f"--with-optimizer: {self.directory} holds Muon's state (momentum_buffer; --optimizer muon). "
                "mega converts Adam's state only: Megatron-LM has no distributed-optimizer layout for Muon's "
                "momentum. Convert without --with-optimizer, or resume the mega checkpoint directly "
                "(mega train --load reshards it to any layout)")
        if not set(MOMENTS) <= keys or "step" not in saved["scalars"]:
            raise ConversionError(f"--with-optimizer: {self.directory} holds optimizer state {sorted(keys)}; mega "
                                  "converts Adam's (exp_avg, exp_avg_sq and a step count)")
        self._index = index = read_index(self.directory)
        main_params = all(f"{OPTIMIZER}{name}.{MAIN_PARAM}" in index for name in self._tensors)
        run = (self._metadata.run_config or {}).get("optimizer") or {}
        hyper = {"lr": run.get("lr"), "betas": (run.get("adam_beta1"), run.get("adam_beta2")),
                 "eps": run.get("adam_eps"), "weight_decay": run.get("weight_decay")}
        schedule = megatron_schedule(self._metadata)
        if schedule is not None:
            hyper["schedule"] = schedule
        return OptimizerState(
            keys=tuple(sorted(set(MOMENTS) | ({MAIN_PARAM} if main_params else set()))),
            step=int(saved["scalars"]["step"]), iteration=self._metadata.iteration,
            consumed_samples=self._metadata.consumed_samples,
            hyperparameters={k: v for k, v in hyper.items() if v is not None and v != (None, None)})

    def get_optimizer(self, name: str, key: str) -> torch.Tensor:
        entry = f"{OPTIMIZER}{name}.{key}"
        if getattr(self, "_index", None) is None:
            self._index = read_index(self.directory)
        md = self._index[entry]
        tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        load_entries(self.directory, {entry: ShardedEntry(tuple(tensor.shape), tensor.dtype, [
            Piece(tensor, (0,) * tensor.dim())])}, alone=True)
        return tensor


def check_tensors(what: str, shapes: dict[str, tuple[int, ...]],
                  parameters: dict[str, tuple[tuple[int, ...], bool]], vocab_size: int) -> None:
    """``shapes`` are the model's ``parameters``: the same names, the same shapes but for the
    number of padded vocabulary rows (at least ``vocab_size``)."""
    missing, unexpected = set(parameters) - set(shapes), set(shapes) - set(parameters)
    if missing or unexpected:
        problems = ([f"lacks {format_names(missing)}"] if missing else []) + (
            [f"has {format_names(unexpected)}, which the model does not"] if unexpected else [])
        hint = (" (LoRA adapters: `mega lora merge` folds them into the model, `mega lora export-peft` "
                "writes them for PEFT)") if any(".adapter." in name for name in unexpected) else ""
        raise ConversionError(f"{what} does not match its model config: it {'; it '.join(problems)}{hint}")
    for name, (shape, padded_vocab) in parameters.items():
        fits = shapes[name] == shape
        if padded_vocab:  # any padding, but every token's row
            fits = shapes[name][1:] == shape[1:] and shapes[name][0] >= vocab_size
        if not fits:
            raise ConversionError(f"{what}: {name} has shape {list(shapes[name])}, but the model config "
                                  f"implies {list(shape)}")


def _fit_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocabulary rows a layout pads to: cut the source's padding or add zero rows."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


class MegaFormat:
    name = "mega"

    def detect(self, path: Path) -> bool:
        # Megatron-LM save directories have the same tracker file.
        return (path / METADATA_FILE).is_file() or ((path / TRACKER_FILE).is_file() and find_megatron(path) is None)

    def open(self, path: Path, model_family: str | None = None, allow_unused: bool = False) -> MegaSource:
        return MegaSource(path, model_family)  # a mega checkpoint holds exactly its model's tensors (checked)

    def write(self, source: ModelSource, directory: Path, options: WriteOptions) -> list[str]:
        tp, pp = options.tensor_parallel_size, options.pipeline_parallel_size
        family, config = family_by_name(source.family), source.config
        try:
            split_layers(config.num_layers, pp)
        except PartitionError as error:
            raise ConversionError(f"--target-pipeline-parallel-size {pp}: {error}") from None
        ep = options.expert_parallel_size
        check_layout = getattr(config, "validate_parallel", None)  # experts over ep (MoE families)
        if ep > 1 and check_layout is None:
            raise ConversionError(f"--target-expert-parallel-size {ep}: the {source.family} family has no experts")
        if check_layout is not None:
            try:
                check_layout(ParallelConfig(tp=tp, pp=pp, ep=ep))
            except ValueError as error:
                raise ConversionError(str(error).replace("--expert-model-parallel-size",
                                                         "--target-expert-parallel-size")) from None
        parameters = model_parameters(family, config, tp)
        check_tensors(f"the {source.family} source", {name: source.shape(name) for name in source.names()},
                      parameters, config.vocab_size)
        meter = Progress(sum(tensor_nbytes(shape, source.dtype(name)) for name, (shape, _) in parameters.items()),
                         config.num_layers, options.progress)

        def produce(name: str, shape: tuple[int, ...], padded_vocab: bool) -> torch.Tensor:
            tensor = source.get(name)
            tensor = _fit_rows(tensor, shape[0]) if padded_vocab else tensor
            meter.advance(name, tensor.numel() * tensor.element_size())
            return tensor

        tensors = {name: LazyTensor(shape, source.dtype(name), lambda n=name, s=shape, p=padded: produce(n, s, p))
                   for name, (shape, padded) in parameters.items()}
        optimizer = optimizer_state_of(source, "the input") if options.with_optimizer else None
        moments = None if optimizer is None else _optimizer_tensors(
            source, optimizer, model_parameters(family, config, tp, trained_only=True))
        metadata = CheckpointMetadata(
            iteration=0 if optimizer is None else optimizer.iteration,
            consumed_samples=0 if optimizer is None else optimizer.consumed_samples,
            optimizer=None if optimizer is None else {
                "state_keys": sorted(MOMENTS), "scalars": {"step": float(optimizer.step)},
                "main_params": MAIN_PARAM in optimizer.keys},
            model_family=family.name, model_config=dataclasses.asdict(config),
            layout={"world_size": tp * pp * ep, "tp": tp, "pp": pp, "dp": ep, "cp": 1, "ep": ep, "vpp": 1},
            num_parameters=family.num_parameters(config, tp), mega_version=__version__,
            source=getattr(source, "origin", None),
        )
        try:
            write_checkpoint(directory, metadata, tensors, source.tokenizer, list(source.tokenizer_extras.values()),
                             optimizer=moments)
        except CheckpointError as error:
            raise ConversionError(str(error)) from None
        finally:
            meter.close()
        return []


def megatron_schedule(metadata: CheckpointMetadata) -> dict | None:
    """The run's learning-rate and weight-decay schedule as Megatron-LM's ``opt_param_scheduler``
    state (counted in samples, as Megatron counts it); None when the run's batch size is unknown."""
    run = metadata.run_config or {}
    optimizer, training = run.get("optimizer") or {}, run.get("training") or {}
    batch = training.get("global_batch_size") or (
        metadata.consumed_samples // metadata.iteration if metadata.iteration else None)
    if not batch or not optimizer or "train_iters" not in training:
        return None
    train_samples = training["train_iters"] * batch
    return {"max_lr": optimizer["lr"], "min_lr": optimizer["min_lr"],
            "lr_warmup_steps": optimizer["lr_warmup_iters"] * batch,
            "lr_decay_steps": (optimizer.get("lr_decay_iters") or training["train_iters"]) * batch,
            "lr_decay_style": optimizer["lr_decay_style"], "num_steps": metadata.consumed_samples,
            "start_wd": optimizer["weight_decay"], "end_wd": optimizer["weight_decay"],
            "wd_incr_style": "constant", "wd_incr_steps": train_samples}


def _optimizer_tensors(source, optimizer: OptimizerState, parameters: dict) -> dict[str, LazyTensor]:
    """``<name>.<key>`` -> the source's optimizer tensor, read when written (vocabulary rows fitted
    to the layout as the weights': padding rows have zero state)."""
    def produce(name: str, key: str, shape: tuple[int, ...], padded_vocab: bool) -> torch.Tensor:
        tensor = source.get_optimizer(name, key)
        return _fit_rows(tensor, shape[0]) if padded_vocab else tensor

    return {f"{name}.{key}": LazyTensor(shape, torch.float32,
                                        lambda n=name, k=key, s=shape, p=padded: produce(n, k, s, p).float())
            for name, (shape, padded) in parameters.items() for key in optimizer.keys}


MEGA_FORMAT = MegaFormat()
