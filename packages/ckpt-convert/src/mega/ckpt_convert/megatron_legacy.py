"""Megatron-LM's legacy checkpoints (``--ckpt-format torch``): one ``torch.save`` dict per tp/pp rank,
``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holding ``args``, ``checkpoint_version``,
``iteration`` and ``model`` (the rank's ``state_dict()``; optimizer and RNG state beside it).

Reading merges each tensor's shards (files are memory-mapped, so a rank's optimizer state is not
read); writing makes one rank's dict at a time, each tensor split from the global one.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.megatron_args import args_for
from mega.ckpt_convert.megatron_directory import (
    RANK_FILE,
    TRACKER_FILE,
    MegatronCheckpoint,
    iteration_dir_name,
    rank_dir_name,
    rank_files,
)
from mega.ckpt_convert.megatron_layout import TensorLayout, model_layouts, stage_layers, stage_of
from mega.ckpt_convert.megatron_names import LAYER_PREFIX, MegatronNames, mega_name, names_for
from mega.ckpt_convert.megatron_pickle import load_megatron_pickle
from mega.ckpt_convert.megatron_source import MegatronSource

CHECKPOINT_VERSION = 3.0  # what Megatron-LM's save_checkpoint records


def flatten(state, prefix: str = "") -> dict:
    """A (nested, for older models) state dict as one level of dotted names."""
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _stages(args, num_layers: int, pp: int) -> list[range]:
    return stage_layers(num_layers, pp, getattr(args, "decoder_first_pipeline_num_layers", None),
                        getattr(args, "decoder_last_pipeline_num_layers", None))


class LegacySource(MegatronSource):
    kind = "legacy (--ckpt-format torch)"

    def __init__(self, checkpoint: MegatronCheckpoint, model_family: str | None):
        directory = checkpoint.directory
        files = rank_files(directory)
        states = {rank_stage: load_megatron_pickle(file) for rank_stage, file in sorted(files.items())}
        first = states[0, 0]
        where = str(files[0, 0])
        if not isinstance(first, dict) or "model" not in first:
            raise ConversionError(f"{where} holds no 'model' state dict; it is not a Megatron-LM checkpoint file")
        self._setup(directory, first.get("args"), first.get("iteration"), where, model_family)
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        found_tp, found_pp = max(r for r, _ in files) + 1, max(s for _, s in files) + 1
        if (found_tp, found_pp) != (tp, pp):
            raise ConversionError(f"{directory} holds {found_tp} x {found_pp} rank directories (tp x pp), but its "
                                  f"args say tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}")
        names = names_for(self.family)
        stages = _stages(self.args, self.config.num_layers, pp)
        tied = not self.config.untie_embeddings_and_output_weights
        self._shards: dict[str, dict[int, torch.Tensor]] = {}
        self._found = {}
        for (rank, stage), state in states.items():
            model = state.get("model") if isinstance(state, dict) else None
            if not isinstance(model, dict):
                holds = sorted(state) if isinstance(state, dict) else type(state).__name__
                raise ConversionError(f"{files[rank, stage]} has no 'model' state dict (it holds {holds}; "
                                      "interleaved-pipeline model0/model1 files are not supported)")
            for key, value in flatten(model).items():
                if key.endswith("_extra_state"):  # Transformer Engine's FP8 scales: not weights
                    continue
                if not torch.is_tensor(value):
                    raise ConversionError(f"{files[rank, stage]}: model entry {key} is a {type(value).__name__}, "
                                          "not a tensor")
                if tied and pp > 1 and stage == pp - 1 and key in names.tied_copies:
                    continue  # the last stage's copy of the tied embedding
                name = mega_name(names, key, stages[stage].start)
                self._shards.setdefault(name, {})[rank] = value
                self._found.setdefault(name, (None, value.dtype, files[rank, stage]))
        for name, shards in self._shards.items():
            layout = self.layouts.get(name)
            if layout is not None and len(shards) != tp:
                raise ConversionError(f"{directory}: {name} is in {len(shards)} of the {tp} tensor-parallel ranks")
            local = tuple(shards[min(shards)].shape)
            shape = list(local)
            if layout is not None and layout.dim is not None and layout.dim < len(shape):
                shape[layout.dim] *= tp
            self._found[name] = (tuple(shape), *self._found[name][1:])
        self._check(str(directory))

    def get(self, name: str) -> torch.Tensor:
        shards = self._shards[name]
        return self.layouts[name].merge([shards[rank] for rank in range(len(shards))])


def _extra_state_keys(names: MegatronNames, layers: int, last_stage: bool) -> list[str]:
    keys = [f"{LAYER_PREFIX}{n}.{module}._extra_state" for n in range(layers)
            for module in names.extra_state_layer_modules]
    return keys + ([f"{module}._extra_state" for module in names.extra_state_modules] if last_stage else [])


def fit_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocabulary rows a layout pads to: cut the source's padding or add zero rows."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def write_legacy(source, family, directory: Path, tp: int, pp: int, iteration: int | None) -> None:
    """``source`` as Megatron-LM's legacy files at tp x pp in ``directory`` (a new save directory)."""
    config = source.config
    layouts: dict[str, TensorLayout] = model_layouts(family, config, tp)
    names = names_for(family.name)
    stages = stage_layers(config.num_layers, pp)
    tied = not config.untie_embeddings_and_output_weights
    args = args_for(config, tp, pp, config.padded_vocab_size(tp), iteration or 0, "torch", source.tokenizer)
    placements = {name: stage_of(name, stages, tied) for name in layouts}
    checkpoint_dir = directory / iteration_dir_name(iteration)
    for stage in range(pp):
        for rank in range(tp):
            model = OrderedDict()
            for name, layout in layouts.items():
                for where, key in placements[name]:
                    if where == stage:
                        tensor = source.get(name)
                        if layout.padded_vocab:
                            tensor = fit_rows(tensor, layout.shape[0])
                        model[key] = layout.split(tensor, rank, tp).to(source.dtype(name)).clone()
            for key in _extra_state_keys(names, len(stages[stage]), stage == pp - 1):
                model[key] = None
            path = checkpoint_dir / rank_dir_name(rank, stage, pp) / RANK_FILE
            path.parent.mkdir(parents=True)
            state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration or 0,
                     "model": model}
            with open(path, "wb") as stream:
                torch.save(state, stream)
                stream.flush()
                os.fsync(stream.fileno())
            del model, state
    (directory / TRACKER_FILE).write_text(f"{iteration if iteration is not None else 'release'}\n")

