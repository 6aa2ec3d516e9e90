"""Megatron-LM's legacy checkpoints (``--ckpt-format torch``): one ``torch.save`` dict per tp/pp rank,
``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holding ``args``, ``checkpoint_version``,
``iteration`` and ``model`` (the rank's ``state_dict()``; optimizer and RNG state beside it).

Reading merges each tensor's shards (files are memory-mapped, so a rank's optimizer state is not
read); writing makes one rank's dict at a time, each tensor split from the global one.
"""

from __future__ import annotations

import functools
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
    first_rank_file,
    iteration_dir_name,
    last_rank_file,
    rank_dir_name,
    rank_files,
)
from mega.ckpt_convert.megatron_layout import TensorLayout, model_layouts, stage_layers, stage_of
from mega.ckpt_convert.megatron_names import (
    LAYER_PREFIX,
    MegatronNames,
    expert_of,
    mega_name,
    names_for,
    split_layer,
    split_stack_layer,
    stack_sizes,
)
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


def expert_layout(name: str, config) -> TensorLayout:
    """How one expert's matrix (shape left out) is split over tensor-parallel ranks: as the dense
    MLP's (fc1 column-parallel, SwiGLU's gate and up halves each on their own; fc2 row-parallel)."""
    if name.endswith("linear_fc1.weight"):
        return TensorLayout((), 0, 2 if config.swiglu else 1, False)
    return TensorLayout((), 1, 1, False)


def _global_shape(local: tuple[int, ...], dim: int, tp: int) -> tuple[int, ...]:
    return tuple(size * tp if d == dim else size for d, size in enumerate(local))


def chunk_layers(args, num_layers: int, pp: int, vpp: int) -> dict[tuple[int, int], range]:
    """(pipeline stage, model chunk) -> its global layers. An interleaved pipeline (``vpp`` chunks
    per stage, files holding ``model0``, ``model1``...) cuts the layers into pp x vpp even pieces
    dealt round the stages: chunk v of stage p holds piece v * pp + p."""
    if vpp == 1:
        return {(stage, 0): layers for stage, layers in enumerate(_stages(args, num_layers, pp))}
    for uneven in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(args, uneven, None) is not None:
            raise ConversionError(f"args.{uneven} with virtual_pipeline_model_parallel_size {vpp}: mega reads "
                                  "interleaved pipelines whose layers split evenly")
    pieces = stage_layers(num_layers, pp * vpp)
    return {(stage, chunk): pieces[chunk * pp + stage] for stage in range(pp) for chunk in range(vpp)}


def _model_keys(state: dict) -> list[str]:
    """Every name in a rank file's model state dicts (``model``, or ``model0``, ``model1``...)."""
    return [key for name, model in state.items() if name.startswith("model") and isinstance(model, dict)
            for key in flatten(model)]


class LegacySource(MegatronSource):
    kind = "legacy (--ckpt-format torch)"

    def __init__(self, checkpoint: MegatronCheckpoint, model_family: str | None):
        directory = checkpoint.directory
        where = str(first_rank_file(directory))
        first = load_megatron_pickle(Path(where))
        if not isinstance(first, dict) or not ("model" in first or "model0" in first):  # model0...: interleaved
            raise ConversionError(f"{where} holds no 'model' state dict; it is not a Megatron-LM checkpoint file")
        # The heads are on the last pipeline stage: its names with the first stage's tell the family.
        last = load_megatron_pickle(last_rank_file(directory))
        self._setup(directory, first.get("args"), first.get("iteration"), where, model_family,
                    [*_model_keys(first), *(_model_keys(last) if isinstance(last, dict) else ())])
        del first, last
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        refuse_split_stacks(names_for(self.family), pp, where)
        ep = getattr(self.args, "expert_model_parallel_size", None) or 1
        etp = getattr(self.args, "expert_tensor_parallel_size", None)
        if getattr(self.config, "num_experts", None) and etp not in (None, tp):
            raise ConversionError(f"{where}: args.expert_tensor_parallel_size {etp} differs from "
                                  f"tensor_model_parallel_size {tp}; mega reads legacy MoE files whose experts are "
                                  "split over the tensor-parallel ranks as the dense layers are")
        self._files = files = rank_files(directory, pp, ep)
        found_tp = max(r for r, _, _ in files) + 1
        if found_tp != tp:
            raise ConversionError(f"{directory} holds rank directories of {found_tp} tensor-parallel ranks, but its "
                                  f"args say tensor_model_parallel_size={tp}")
        local_experts = (getattr(self.config, "num_experts", None) or ep) // ep
        names = names_for(self.family)
        self.chunks = vpp = getattr(self.args, "virtual_pipeline_model_parallel_size", None) or 1
        places = chunk_layers(self.args, self.config.num_layers, pp, vpp)
        tied = not self.config.untie_embeddings_and_output_weights
        # A place is (pipeline stage, model chunk): where a tensor is in a rank's files.
        # mega name -> tp rank -> (place, name in the file), and the local shapes
        self._shards: dict[str, dict[int, tuple[tuple[int, int], str]]] = {}
        # mega name of a stacked expert tensor -> global expert -> tp rank -> (place, expert rank, name in the file)
        self._experts: dict[str, dict[int, dict[int, tuple[tuple[int, int], int, str]]]] = {}
        local_shapes: dict[str, tuple[int, ...]] = {}
        self._found = {}
        for (rank, stage, expert_rank), file in sorted(files.items()):
            for chunk in range(vpp):
                place = (stage, chunk)
                # Files are memory-mapped and let go once listed: only their pickles are read here.
                for key, value in self._model(file, chunk, vpp).items():
                    if key.endswith("_extra_state") or key in names.duplicate_keys:  # FP8 scales; second names
                        continue
                    if not torch.is_tensor(value):
                        raise ConversionError(f"{file}: model entry {key} is a {type(value).__name__}, "
                                              "not a tensor")
                    if tied and pp > 1 and place == (pp - 1, vpp - 1) and key in names.tied_copies:
                        continue  # the last stage's copy of the tied embedding
                    name = mega_name(names, key, places[place].start)
                    stacked = _stacked_expert(names, name, expert_rank, local_experts)
                    if stacked is not None:  # at tp > 1, each rank holds its part of every local expert
                        name, global_expert = stacked
                        self._experts.setdefault(name, {}).setdefault(global_expert, {})[rank] = (place, expert_rank,
                                                                                                  key)
                        self._found.setdefault(name, (_global_shape(tuple(value.shape), expert_layout(name, self.config).dim, tp),
                                                      value.dtype, file))
                        continue
                    if expert_rank > 0:  # every expert rank holds the same dense tensors
                        continue
                    self._shards.setdefault(name, {})[rank] = (place, key)
                    local_shapes.setdefault(name, tuple(value.shape))
                    self._found.setdefault(name, (None, value.dtype, file))
        for name, experts in self._experts.items():
            if sorted(experts) != list(range(len(experts))):
                raise ConversionError(f"{directory}: {name} has experts {sorted(experts)}, not 0 to {len(experts) - 1}")
            partial = [e for e, ranks in experts.items() if len(ranks) != tp]
            if partial:
                raise ConversionError(f"{directory}: {name} of expert {partial[0]} is in {len(experts[partial[0]])} "
                                      f"of the {tp} tensor-parallel ranks")
            shape, *rest = self._found[name]
            self._found[name] = ((len(experts), *shape), *rest)
        for name, shards in self._shards.items():
            layout = self.layouts.get(name)
            if layout is not None and len(shards) != tp:
                raise ConversionError(f"{directory}: {name} is in {len(shards)} of the {tp} tensor-parallel ranks")
            shape = list(local_shapes[name])
            if layout is not None and layout.dim is not None and layout.dim < len(shape):
                shape[layout.dim] *= tp
            self._found[name] = (tuple(shape), *self._found[name][1:])
        self._check(str(directory))

    @staticmethod
    def _model(file: Path, chunk: int = 0, chunks: int = 1) -> dict:
        """The state dict of model chunk ``chunk`` in ``file`` (``model``, or ``model0``,
        ``model1``... in an interleaved pipeline's files)."""
        state = load_megatron_pickle(file)
        key = "model" if chunks == 1 else f"model{chunk}"
        model = state.get(key) if isinstance(state, dict) else None
        if not isinstance(model, dict):
            holds = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ConversionError(f"{file} has no {key!r} state dict (it holds {holds}); its args say "
                                  f"virtual_pipeline_model_parallel_size={chunks if chunks > 1 else None}")
        return flatten(model)

    def optimizer_state(self):
        """The regular optimizer's Adam state in every rank file, indexed by mega name and tp rank
        (:mod:`mega.ckpt_convert.megatron_legacy_optimizer`)."""
        from mega.ckpt_convert.megatron_distopt import read_distrib_optim, shared_embedding_keys
        from mega.ckpt_convert.megatron_legacy_optimizer import chained_parts, read_rank_optimizer
        from mega.ckpt_convert.optimizer_state import MAIN_PARAM, MOMENTS, OptimizerState

        if getattr(self, "_optimizer", None) is not None:
            return self._optimizer
        distributed = bool(getattr(self.args, "use_distributed_optimizer", False))
        names = names_for(self.family)
        places = chunk_layers(self.args, self.config.num_layers, self.pipeline_parallel_size, self.chunks)
        tied = not self.config.untie_embeddings_and_output_weights
        last_place = (self.pipeline_parallel_size - 1, self.chunks - 1)
        self._optimizer_shards: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        # mega name of a stacked expert tensor -> global expert -> tp rank -> {mega key: tensor}
        self._optimizer_experts: dict[str, dict[int, dict[int, dict[str, torch.Tensor]]]] = {}
        ep = getattr(self.args, "expert_model_parallel_size", None) or 1
        local_experts = (getattr(self.config, "num_experts", None) or ep) // ep
        steps, hyper, state = set(), {}, None

        def is_expert(key: str) -> bool:
            return _expert_of_file_key(names, key) is not None

        for (rank, stage, expert_rank), file in sorted(self._files.items()):
            state = load_megatron_pickle(file)
            chunks = ["model"] if self.chunks == 1 else [f"model{chunk}" for chunk in range(self.chunks)]
            # The chunk's name in front keeps an interleaved file's chunks apart ("model1.decoder.layers.0...").
            parameters = [(f"{chunk}.{key}", value) for chunk in chunks for key, value in flatten(state[chunk]).items()
                          if torch.is_tensor(value) and key not in names.duplicate_keys]
            if distributed:
                first, last = ("model.", "model.") if self.chunks == 1 else ("model0.", f"model{self.chunks - 1}.")
                own_bucket = shared_embedding_keys(self.config, self.pipeline_parallel_size, first, last)
                found, step, hyper = read_distrib_optim(file, state, parameters, self.args, own_bucket, self.chunks,
                                                        is_expert)
            else:
                found = {}
                for part_state, part in chained_parts(state.get("optimizer"), parameters, is_expert, str(file)):
                    part_found, step, part_hyper = read_rank_optimizer(part_state, part, str(file))
                    found.update(part_found)
                    steps.add(step)
                    hyper = hyper or part_hyper
            steps.add(step)
            for chunk_key, tensors in found.items():
                chunk, _, key = chunk_key.partition(".")
                place = (stage, 0 if chunk == "model" else int(chunk[len("model"):]))
                if tied and self.pipeline_parallel_size > 1 and place == last_place and key in names.tied_copies:
                    continue  # the last stage's copy of the tied embedding (the first stage's state is carried)
                name = mega_name(names, key, places[place].start)
                stacked = _stacked_expert(names, name, expert_rank, local_experts)
                if stacked is not None:  # stacked as the weights are
                    self._optimizer_experts.setdefault(stacked[0], {}).setdefault(stacked[1], {})[rank] = tensors
                elif expert_rank == 0:  # every expert rank holds the same dense parameters' state
                    self._optimizer_shards.setdefault(name, {})[rank] = tensors
        if len(steps) != 1:
            raise ConversionError(f"{self.directory}: the rank files' optimizer step counts differ: {sorted(steps)}")
        missing = set(self.layouts) - set(self._optimizer_shards) - set(self._optimizer_experts)
        if missing:
            from mega.ckpt_convert.source import format_names

            raise ConversionError(f"{self.directory}: the optimizer state lacks {format_names(missing)}")
        if isinstance(state.get("opt_param_scheduler"), dict):
            hyper["schedule"] = state["opt_param_scheduler"]
        main = all(MAIN_PARAM in ranks[0] for ranks in self._optimizer_shards.values()) and \
            all(MAIN_PARAM in ranks[0] for experts in self._optimizer_experts.values() for ranks in experts.values())
        self._optimizer = OptimizerState(
            keys=tuple(sorted(set(MOMENTS) | ({MAIN_PARAM} if main else set()))), step=steps.pop(),
            iteration=int(self.iteration or 0),
            consumed_samples=int(getattr(self.args, "consumed_train_samples", 0) or 0), hyperparameters=hyper)
        return self._optimizer

    def get_optimizer(self, name: str, key: str) -> torch.Tensor:
        self.optimizer_state()
        if name in self._optimizer_experts:
            layout = expert_layout(name, self.config)
            return torch.stack([layout.merge([ranks[rank][key] for rank in range(len(ranks))])
                                for _, ranks in sorted(self._optimizer_experts[name].items())])
        shards = self._optimizer_shards[name]
        merged = self.layouts[name].merge([shards[rank][key] for rank in range(len(shards))])
        return merged.clone() if merged is shards[0][key] else merged

    def get(self, name: str) -> torch.Tensor:
        """The merged tensor, read from each rank's file mapped just for it: keeping every file
        mapped would leave each tensor's pages resident, the model's size in all."""
        if name in self._experts:
            layout = expert_layout(name, self.config)
            return torch.stack([layout.merge([self._model(self._files[rank, stage, expert_rank], chunk, self.chunks)[key]
                                              for rank, ((stage, chunk), expert_rank, key) in sorted(ranks.items())])
                                for _, ranks in sorted(self._experts[name].items())])
        shards = self._shards[name]
        local = []
        for rank in range(len(shards)):
            (stage, chunk), key = shards[rank]
            local.append(self._model(self._files[rank, stage, 0], chunk, self.chunks)[key])
        merged = self.layouts[name].merge(local)
        return merged.clone() if merged is local[0] else merged


def _stacked_expert(names: MegatronNames, name: str, expert_rank: int, local_experts: int) -> tuple[str, int] | None:
    """(mega's stacked name, global expert) of one expert's tensor of expert-parallel rank
    ``expert_rank`` (files number their own experts from 0), mega-named ``name``; None for others."""
    layer = split_layer(name)
    expert = expert_of(names, layer[1]) if layer is not None else None
    if expert is None:
        return None
    return f"{LAYER_PREFIX}{layer[0]}.{expert[0]}", expert_rank * local_experts + expert[1]


def _expert_of_file_key(names: MegatronNames, key: str) -> tuple[str, int] | None:
    """(mega's layer-local stacked name, expert number) of one expert's tensor in a rank file's model
    state dict (``key``, perhaps behind a model chunk's name); None for the others."""
    layer = split_stack_layer(key) or split_stack_layer(key.partition(".")[2])
    return expert_of(names, layer[2]) if layer is not None else None


def refuse_split_stacks(names: MegatronNames, pp: int, where: str) -> None:
    """Legacy files of an encoder-decoder split over pipeline stages number each stack per stage
    around ``--pipeline-model-parallel-split-rank``, which mega does not read or write."""
    if pp > 1 and len(names.stacks) > 1:
        raise ConversionError(f"{where}: pipeline_model_parallel_size {pp}; mega reads and writes legacy "
                              "encoder-decoder (T5) files of one pipeline stage (torch_dist ones at any layout)")


def _extra_state_keys(names: MegatronNames, layouts, stage_sizes: dict[str, int], last_stage: bool,
                      experts: int) -> list[str]:
    """The ``_extra_state`` entries of one stage's state dict (``stage_sizes``: stack -> its layers there)."""
    keys = []
    for stack, layers in stage_sizes.items():
        modules = [module for module in names.extra_state_layer_modules if f"{stack}0.{module}.weight" in layouts]
        modules += [names.expert_file_name.format(expert=e, part=part)
                    for e in range(experts) for part in names.expert_extra_state_parts]
        keys += [f"{stack}{n}.{module}._extra_state" for n in range(layers) for module in modules]
    return keys + ([f"{module}._extra_state" for module in names.extra_state_modules] if last_stage else [])


def fit_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocabulary rows a layout pads to: cut the source's padding or add zero rows."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def write_legacy(source, family, directory: Path, tp: int, pp: int, iteration: int | None, optimizer=None) -> None:
    """``source`` as Megatron-LM's legacy files at tp x pp in ``directory`` (a new save directory);
    with ``optimizer`` (the source's :class:`~mega.ckpt_convert.optimizer_state.OptimizerState`),
    each rank's regular-optimizer state too, its model state dict in megatron-core's parameter order."""
    from mega.ckpt_convert.megatron_legacy_optimizer import ORDERS, rank_optimizer

    config = source.config
    layouts: dict[str, TensorLayout] = model_layouts(family, config, tp)
    names = names_for(family.name)
    stages = stage_layers(config.num_layers, pp)
    whole_stacks = stack_sizes(names, layouts)
    tied = not config.untie_embeddings_and_output_weights
    args = args_for(config, tp, pp, config.padded_vocab_size(tp), iteration or 0, "torch", source.tokenizer)
    if optimizer is not None:
        args.consumed_train_samples = optimizer.consumed_samples
    placements = {name: stage_of(name, stages, tied, names.stacks[0]) for name in layouts}
    # Experts' state is read stacked and written an expert at a time: the last few stacks are kept.
    stacked_state = functools.lru_cache(maxsize=8)(lambda name, key: source.get_optimizer(name, key))
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
                        prefix, _, part = key.rpartition("mlp.experts.")
                        if names.expert_patterns and prefix and part.startswith("linear_fc"):
                            # one key per expert, each split over the tensor-parallel ranks as a dense MLP
                            split = expert_layout(name, config).split
                            for expert, weight in enumerate(tensor.to(source.dtype(name))):
                                model[prefix + names.expert_file_name.format(expert=expert, part=part)] = \
                                    split(weight, rank, tp).clone()
                            continue
                        model[key] = layout.split(tensor, rank, tp).to(source.dtype(name)).clone()
            for key, name in names.duplicate_keys.items():
                if name in model:
                    model[key] = model[name]
            parameters = [(key, value) for key, value in model.items() if key not in names.duplicate_keys]
            if optimizer is not None:  # indices follow the model's parameter order: megatron-core's
                parameters.sort(key=lambda item: ORDERS[family.name].key(item[0]))
                model = OrderedDict(parameters + [(key, value) for key, value in model.items()
                                                  if key in names.duplicate_keys])
            experts = getattr(config, "num_experts", 0) if names.expert_patterns else 0
            stage_sizes = {names.stacks[0]: len(stages[stage])} if pp > 1 else whole_stacks
            for key in _extra_state_keys(names, layouts, stage_sizes, stage == pp - 1, experts):
                model[key] = None
            path = checkpoint_dir / rank_dir_name(rank, stage, pp) / RANK_FILE
            path.parent.mkdir(parents=True)
            state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration or 0,
                     "model": model}
            if optimizer is not None:
                owners = {key: name for name in layouts for where, key in placements[name] if where == stage}

                def state_of(key: str, rank: int = rank, owners: dict = owners) -> dict[str, torch.Tensor]:
                    expert = _expert_of_file_key(names, key)
                    if expert is not None:  # one expert of the stacked tensor
                        stack, number, _ = split_stack_layer(key)
                        name = owners[f"{stack}{number}.{expert[0]}"]
                        split = expert_layout(name, config).split
                        return {k: split(stacked_state(name, k)[expert[1]], rank, tp) for k in optimizer.keys}
                    name = owners[key]
                    layout = layouts[name]
                    tensors = {k: source.get_optimizer(name, k) for k in optimizer.keys}
                    return {k: layout.split(fit_rows(t, layout.shape[0]) if layout.padded_vocab else t, rank, tp)
                            for k, t in tensors.items()}

                # One optimizer, experts too: megatron-core chains a second for them only under expert parallelism.
                state["optimizer"] = rank_optimizer(parameters, state_of, optimizer)
                if "schedule" in optimizer.hyperparameters:  # Megatron-LM's load_checkpoint requires it
                    state["opt_param_scheduler"] = optimizer.hyperparameters["schedule"]
            with open(path, "wb") as stream:
                torch.save(state, stream)
                stream.flush()
                os.fsync(stream.fileno())
            del model, state
    (directory / TRACKER_FILE).write_text(f"{iteration if iteration is not None else 'release'}\n")

