"""Reading Megatron-LM's legacy checkpoints (``--ckpt-format torch``): one ``torch.save`` dict per
tp/pp rank, ``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holding ``args``,
``checkpoint_version``, ``iteration`` and ``model`` (the rank's ``state_dict()``; optimizer and RNG
state beside it).

Each tensor's shards are merged (files are memory-mapped, so a rank's optimizer state is not read).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.megatron.buffer_optimizer import read_distrib_optim, shared_embedding_keys
from mega.ckpt_convert.megatron.chained import chained_parts
from mega.ckpt_convert.megatron.directory import (
    MegatronCheckpoint,
    first_rank_file,
    last_rank_file,
    rank_files,
)
from mega.ckpt_convert.megatron.layout import (
    chunk_layers,
    expert_layout,
    global_shape,
    refuse_legacy,
    refuse_split_stacks,
)
from mega.ckpt_convert.megatron.legacy_optimizer import read_rank_optimizer
from mega.ckpt_convert.megatron.names import expert_of_file_key, mega_name, names_for, stacked_expert
from mega.ckpt_convert.megatron.pickles import load_megatron_pickle
from mega.ckpt_convert.megatron.source import MegatronSource
from mega.ckpt_convert.optimizer_state import MAIN_PARAM, MOMENTS, OptimizerState
from mega.ckpt_convert.source import format_names


def flatten(state, prefix: str = "") -> dict:
    """A (nested, for older models) state dict as one level of dotted names."""
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _model_keys(state: dict) -> list[str]:
    """Every name in a rank file's model state dicts (``model``, or ``model0``, ``model1``...)."""
    return [key for name, model in state.items() if name.startswith("model") and isinstance(model, dict)
            for key in flatten(model)]


def _model_of(file: Path, chunk: int = 0, chunks: int = 1) -> dict:
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


class LegacySource(MegatronSource):
    kind = "legacy (--ckpt-format torch)"

    def __init__(self, checkpoint: MegatronCheckpoint, model_family: str | None, allow_unused: bool = False):
        directory, self.allow_unused = checkpoint.directory, allow_unused
        where = str(first_rank_file(directory))
        first = load_megatron_pickle(Path(where))
        if not isinstance(first, dict) or not ("model" in first or "model0" in first):  # model0...: interleaved
            raise ConversionError(f"{where} holds no 'model' state dict; it is not a Megatron-LM checkpoint file")
        # The heads are on the last pipeline stage: its names with the first stage's tell the family.
        last = load_megatron_pickle(last_rank_file(directory))
        self._setup(directory, first.get("args"), first.get("iteration"), where, model_family,
                    [*_model_keys(first), *(_model_keys(last) if isinstance(last, dict) else ())])
        del first, last
        self._refuse(where)
        self._files = rank_files(directory, self.pipeline_parallel_size, self.expert_parallel_size)
        found_tp = max(r for r, _, _ in self._files) + 1
        if found_tp != self.tensor_parallel_size:
            raise ConversionError(f"{directory} holds rank directories of {found_tp} tensor-parallel ranks, but its "
                                  f"args say tensor_model_parallel_size={self.tensor_parallel_size}")
        self.chunks = getattr(self.args, "virtual_pipeline_model_parallel_size", None) or 1
        self._list_tensors()
        self._check(str(directory))
        self._check_copies()

    @property
    def expert_parallel_size(self) -> int:
        return getattr(self.args, "expert_model_parallel_size", None) or 1

    @property
    def _local_experts(self) -> int:
        ep = self.expert_parallel_size
        return (getattr(self.config, "num_experts", None) or ep) // ep

    def _refuse(self, where: str) -> None:
        """Layouts of legacy files that mega does not read, refused by name."""
        tp = self.tensor_parallel_size
        refuse_legacy(names_for(self.family), self.family, where)
        refuse_split_stacks(names_for(self.family), self.pipeline_parallel_size, where)
        etp = getattr(self.args, "expert_tensor_parallel_size", None)
        if getattr(self.config, "num_experts", None) and etp not in (None, tp):
            raise ConversionError(f"{where}: args.expert_tensor_parallel_size {etp} differs from "
                                  f"tensor_model_parallel_size {tp}; mega reads legacy MoE files whose experts are "
                                  "split over the tensor-parallel ranks as the dense layers are")

    def _file_tensors(self):
        """(tp rank, place, expert rank, key in the file, tensor, file) of every model tensor of every
        rank file that carries weights: FP8 scales, second names and the last stage's copy of a
        tied embedding are left out. A place is (pipeline stage, model chunk)."""
        names, pp, vpp = names_for(self.family), self.pipeline_parallel_size, self.chunks
        tied = not self.config.untie_embeddings_and_output_weights
        # (tp rank, place, key, file, mega name of the tensor it repeats) of each second copy
        self._copies: list[tuple[int, tuple[int, int], str, Path, str]] = []
        for (rank, stage, expert_rank), file in sorted(self._files.items()):
            for chunk in range(vpp):
                place = (stage, chunk)
                # Files are memory-mapped and let go once listed: only their pickles are read here.
                for key, value in _model_of(file, chunk, vpp).items():
                    if key.endswith("_extra_state"):  # FP8 scales
                        continue
                    if key in names.duplicate_keys and expert_rank == 0:  # a second name of one tensor
                        self._copies.append((rank, place, key, file, names.duplicate_keys[key]))
                        continue
                    if not torch.is_tensor(value):
                        raise ConversionError(f"{file}: model entry {key} is a {type(value).__name__}, "
                                              "not a tensor")
                    if tied and pp > 1 and place == (pp - 1, vpp - 1) and key in names.tied_copies:
                        if expert_rank == 0:  # the last stage's copy of the tied embedding
                            self._copies.append((rank, place, key, file, "embedding.word_embeddings.weight"))
                        continue
                    yield rank, place, expert_rank, key, value, file

    def _list_tensors(self) -> None:
        """Where each mega tensor's shards are (``_shards``, ``_experts``) and its global shape (``_found``)."""
        names, tp = names_for(self.family), self.tensor_parallel_size
        places = chunk_layers(self.args, self.config.num_layers, self.pipeline_parallel_size, self.chunks)
        # mega name -> tp rank -> (place, name in the file), and the local shapes
        self._shards: dict[str, dict[int, tuple[tuple[int, int], str]]] = {}
        # mega name of a stacked expert tensor -> global expert -> tp rank -> (place, expert rank, name in the file)
        self._experts: dict[str, dict[int, dict[int, tuple[tuple[int, int], int, str]]]] = {}
        local_shapes: dict[str, tuple[int, ...]] = {}
        self._found = {}
        for rank, place, expert_rank, key, value, file in self._file_tensors():
            name = mega_name(names, key, places[place].start)
            stacked = stacked_expert(names, name, expert_rank, self._local_experts)
            if stacked is not None:  # at tp > 1, each rank holds its part of every local expert
                name, global_expert = stacked
                self._experts.setdefault(name, {}).setdefault(global_expert, {})[rank] = (place, expert_rank, key)
                local = global_shape(tuple(value.shape), expert_layout(name, self.config).dim, tp)
                self._found.setdefault(name, (local, value.dtype, file))
            elif expert_rank == 0:  # every expert rank holds the same dense tensors
                self._shards.setdefault(name, {})[rank] = (place, key)
                local_shapes.setdefault(name, tuple(value.shape))
                self._found.setdefault(name, (None, value.dtype, file))
        self._global_shapes(local_shapes)

    def _global_shapes(self, local_shapes: dict[str, tuple[int, ...]]) -> None:
        """Every tensor's shards all there; ``_found``'s shapes made global."""
        directory, tp = self.directory, self.tensor_parallel_size
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

    def _check_copies(self) -> None:
        """A tensor the files hold twice is converted once: a second name must equal the tensor it
        names, or it is unused; a tied embedding's last-stage replica that drifted from the first
        stage's (a run whose embedding gradients were not kept in step) is said in a warning."""
        for rank, (_, chunk), key, file, original in self._copies:
            copy = _model_of(file, chunk, self.chunks)[key]
            held = self._shards.get(original, {}).get(rank)
            if held is None:
                self._unused([key], f"a second copy of {original}, which the model of its args does not have")
                continue
            (first_stage, first_chunk), first_key = held
            first = _model_of(self._files[rank, first_stage, 0], first_chunk, self.chunks)[first_key]
            if copy.shape == first.shape and torch.equal(copy, first):
                continue
            if key in names_for(self.family).duplicate_keys:  # a second name: the same tensor, or another one
                self._unused([key], f"which differs from {original} (tensor-parallel rank {rank}), the tensor it "
                                    "is a second name of in the model of its args")
            else:  # the last stage's replica of the tied embedding: one parameter, drifted apart
                self.warnings.append(f"{file}: {key}, the last pipeline stage's replica of the tied {original}, "
                                     f"differs from the first stage's (tensor-parallel rank {rank}); the first "
                                     "stage's is converted")

    def optimizer_state(self):
        """The regular optimizer's Adam state in every rank file, indexed by mega name and tp rank
        (:mod:`mega.ckpt_convert.megatron.legacy_optimizer`), or the distributed optimizer's
        (:func:`~mega.ckpt_convert.megatron.buffer_optimizer.read_distrib_optim`)."""
        if getattr(self, "_optimizer", None) is not None:
            return self._optimizer
        self._optimizer_shards: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        # mega name of a stacked expert tensor -> global expert -> tp rank -> {mega key: tensor}
        self._optimizer_experts: dict[str, dict[int, dict[int, dict[str, torch.Tensor]]]] = {}
        steps, hyper, state = set(), {}, None
        for (rank, stage, expert_rank), file in sorted(self._files.items()):
            state = load_megatron_pickle(file)
            found, file_steps, file_hyper = self._rank_optimizer(file, state)
            steps |= file_steps
            distributed = getattr(self.args, "use_distributed_optimizer", False)
            hyper = file_hyper if distributed else hyper or file_hyper
            self._index_optimizer(found, rank, stage, expert_rank)
        if len(steps) != 1:
            raise ConversionError(f"{self.directory}: the rank files' optimizer step counts differ: {sorted(steps)}")
        missing = set(self.layouts) - set(self._optimizer_shards) - set(self._optimizer_experts)
        if missing:
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

    def _rank_optimizer(self, file: Path, state: dict) -> tuple[dict, set[int], dict]:
        """(chunk-prefixed file key -> {mega key: tensor}, step counts, hyperparameters) of one rank file."""
        names = names_for(self.family)
        chunks = ["model"] if self.chunks == 1 else [f"model{chunk}" for chunk in range(self.chunks)]
        # The chunk's name in front keeps an interleaved file's chunks apart ("model1.decoder.layers.0...").
        parameters = [(f"{chunk}.{key}", value) for chunk in chunks for key, value in flatten(state[chunk]).items()
                      if torch.is_tensor(value) and key not in names.duplicate_keys]

        def is_expert(key: str) -> bool:
            return expert_of_file_key(names, key) is not None

        if getattr(self.args, "use_distributed_optimizer", False):
            first, last = ("model.", "model.") if self.chunks == 1 else ("model0.", f"model{self.chunks - 1}.")
            own_bucket = shared_embedding_keys(self.config, self.pipeline_parallel_size, first, last)
            found, step, hyper = read_distrib_optim(file, state, parameters, self.args, own_bucket, self.chunks,
                                                    is_expert)
            return found, {step}, hyper
        found, steps, hyper = {}, set(), {}
        for part_state, part in chained_parts(state.get("optimizer"), parameters, is_expert, str(file)):
            part_found, step, part_hyper = read_rank_optimizer(part_state, part, str(file))
            found.update(part_found)
            steps.add(step)
            hyper = hyper or part_hyper
        return found, steps, hyper

    def _index_optimizer(self, found: dict, rank: int, stage: int, expert_rank: int) -> None:
        """File the state of one rank file's parameters under their mega names."""
        names = names_for(self.family)
        places = chunk_layers(self.args, self.config.num_layers, self.pipeline_parallel_size, self.chunks)
        tied = not self.config.untie_embeddings_and_output_weights
        last_place = (self.pipeline_parallel_size - 1, self.chunks - 1)
        for chunk_key, tensors in found.items():
            chunk, _, key = chunk_key.partition(".")
            place = (stage, 0 if chunk == "model" else int(chunk[len("model"):]))
            if tied and self.pipeline_parallel_size > 1 and place == last_place and key in names.tied_copies:
                continue  # the last stage's copy of the tied embedding (the first stage's state is carried)
            name = mega_name(names, key, places[place].start)
            stacked = stacked_expert(names, name, expert_rank, self._local_experts)
            if stacked is not None:  # stacked as the weights are
                self._optimizer_experts.setdefault(stacked[0], {}).setdefault(stacked[1], {})[rank] = tensors
            elif expert_rank == 0:  # every expert rank holds the same dense parameters' state
                self._optimizer_shards.setdefault(name, {})[rank] = tensors

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
            return torch.stack([layout.merge([_model_of(self._files[rank, stage, expert_rank], chunk, self.chunks)[key]
                                              for rank, ((stage, chunk), expert_rank, key) in sorted(ranks.items())])
                                for _, ranks in sorted(self._experts[name].items())])
        shards = self._shards[name]
        local = []
        for rank in range(len(shards)):
            (stage, chunk), key = shards[rank]
            local.append(_model_of(self._files[rank, stage, 0], chunk, self.chunks)[key])
        merged = self.layouts[name].merge(local)
        return merged.clone() if merged is local[0] else merged
