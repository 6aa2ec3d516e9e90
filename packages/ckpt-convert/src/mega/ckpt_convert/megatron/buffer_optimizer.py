"""The distributed optimizer's ``dp_reshardable`` state in Megatron-LM torch_dist checkpoints (what
Megatron-LM saves with ``--use-distributed-optimizer`` unless ``--dist-ckpt-optim-fully-reshardable``),
read back into one tensor per parameter.

megatron-core (0.16) keeps the optimizer state in the layout of DDP's gradient buffers and saves it
so: per data-parallel group (``dp_group_idx_G``: one per tensor x pipeline rank), per buffer and
bucket, one flat fp32 tensor per kind (``param``, ``exp_avg``, ``exp_avg_sq``) of the bucket's
elements, ``...gbuf_idx_B.dtype_(param dtype, grad dtype).bucket_idx_K.<kind>``; beside them the
objects ``per_bucket_numel_unpadded`` (each bucket's size) and ``optimizer`` (param groups, step).

Which elements belong to which parameter is not written down; it is how megatron-core's
``_ParamAndGradBuffer`` lays parameters out, rebuilt here from the args: the parameters in reverse
model order, each starting at a multiple of 64 elements, a bucket closed once it reaches
``bucket_size`` (``--ddp-bucket-size``, else max(40M, 1M x dp), only with ``--overlap-grad-reduce``;
one bucket without) and padded at its end to a multiple of lcm(dp, 128) (with 2**16 for
``--ddp-pad-buckets-for-high-nccl-busbw``). The rebuilt bucket sizes must equal the saved
``per_bucket_numel_unpadded``, or the import stops naming both; at pipeline size > 1 a tied
embedding's copies (first and last stage) have a bucket each. Each tensor x pipeline rank saves
its own buffers (see :class:`BufferOptimizer`, which also reads expert parallelism and interleaved
pipelines). Read for GPT, LLaMA, BERT, T5 (one pipeline stage) and Mixtral (its experts parameters
of the buffer an expert at a time) at any tp and pp.

Legacy files (``--ckpt-format torch``) keep the same state per tensor x pipeline rank in
``distrib_optim.pt`` beside ``model_optim_rng.pt`` (``save_parameter_state``): per buffer and
dtype, one flat tensor per kind of every bucket's elements one after the other (padding between
buckets left out), ``numel_unpadded`` their total; the step is in ``model_optim_rng.pt``'s
``optimizer.optimizer.param_groups``. There the parameters are the rank file's model state dict's,
in its order, so any tensor-parallel and pipeline size reads, and an interleaved pipeline's chunks
(one buffer each).
"""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.megatron.chained import chained_parts
from mega.ckpt_convert.megatron.layout import chunk_layers, expert_shard_layout, is_stacked_experts, stage_of
from mega.ckpt_convert.megatron.names import names_for
from mega.ckpt_convert.megatron.param_order import ORDERS
from mega.ckpt_convert.megatron.pickles import load_megatron_pickle
from mega.ckpt_convert.optimizer_state import MAIN_PARAM, OptimizerState

_BUCKET = re.compile(r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                     r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)")
TO_MEGA = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "param": MAIN_PARAM}
PARAM_ALIGNMENT = 64  # elements: megatron-core starts every parameter 128-byte aligned


def _ceil(number: int, divisor: int) -> int:
    return math.ceil(number / divisor) * divisor


def buffer_layout(params: list[tuple[str, int]], dp: int, bucket_size: int | None, high_nccl_busbw: bool,
                  own_bucket: frozenset[str] = frozenset()) -> tuple[dict[str, tuple[int, int, int]], list[int]]:
    """(name -> (bucket, start, end) within the bucket, each bucket's unpadded size) of the gradient
    buffer megatron-core builds for ``params`` ((name, elements) in model order). ``own_bucket``: the
    parameters that get a bucket to themselves (a tied embedding's copies on the first and last
    pipeline stages)."""
    divisor = math.lcm(dp, 128, 2**16) if high_nccl_busbw else math.lcm(dp, 128)
    places, sizes = {}, []
    start = bucket_start = held = end = 0

    def close(at: int) -> int:  # the bucket ends at ``at`` (padded after): where the next starts
        nonlocal bucket_start, held
        sizes.append(at - bucket_start)
        bucket_start, held = _ceil(at, divisor), 0
        return bucket_start

    for name, numel in reversed(params):  # backprop order
        start = _ceil(start, PARAM_ALIGNMENT)
        if name in own_bucket and held:  # what came before closes (its size counting this alignment)
            start = close(start)
        end = start + numel
        places[name] = (len(sizes), start - bucket_start, end - bucket_start)
        held += 1
        full = bucket_size is not None and end - bucket_start >= bucket_size
        start = close(end) if full or name in own_bucket else end
    if held:
        sizes.append(end - bucket_start)
    return places, sizes


def read_object(directory: Path, metadata, key: str):
    """A ShardedObject of the checkpoint (its torch.save bytes), read with mega's allowlist."""
    found = [(index, info) for index, info in metadata.storage_data.items() if index.fqn == key]
    if not found:
        raise ConversionError(f"{directory}: the distributed optimizer's {key} is missing")
    _, info = found[0]
    with open(directory / info.relative_path, "rb") as stream:
        stream.seek(info.offset)
        data = stream.read(info.length)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / key.replace("/", "_")
        path.write_bytes(data)
        return load_megatron_pickle(path)


def shared_embedding_keys(config, pp: int, first: str = "", last: str = "") -> frozenset[str]:
    """The keys of a tied embedding's copies on the first and last pipeline stages (behind the
    ``first`` and ``last`` model chunks' names), which megatron-core's distributed optimizer gives
    a bucket each (none at one stage, or untied)."""
    if pp == 1 or config.untie_embeddings_and_output_weights:
        return frozenset()
    return frozenset((first + "embedding.word_embeddings.weight", last + "output_layer.weight"))


def _refuse_layouts(source, names) -> None:
    """What the buffer layout is not rebuilt for, refused by name before anything is read."""
    args, tp, pp = source.args, source.tensor_parallel_size, source.pipeline_parallel_size
    refusals = {
        "a run with --use-tp-pp-dp-mapping": getattr(args, "use_tp_pp_dp_mapping", False),
        "a run whose experts have a tensor-parallel size of their own":
            getattr(args, "expert_tensor_parallel_size", None) not in (None, tp),
        "an encoder-decoder over pipeline stages": pp > 1 and len(names.stacks) > 1,
    }
    refusal = next((what for what, applies in refusals.items() if applies), None)
    if refusal:
        raise ConversionError(
            f"--with-optimizer: {source.directory} holds the distributed optimizer's dp_reshardable state of "
            f"{refusal}; mega reads it for runs in the default rank order with experts split as the dense layers: "
            "save the run with --dist-ckpt-optim-fully-reshardable, or convert without --with-optimizer")


class BufferOptimizer:
    """The dp_reshardable state of a torch_dist ``source``, per parameter: ``state`` and ``get``.

    Each tensor x pipeline rank saves its own buffers, as data-parallel group ``G`` = its rank in
    the model-parallel group: ``tp_rank + tp * pp_rank`` in megatron-core's default rank order
    (tp-cp-ep-dp-pp). A stage's buffer holds that stage's parameters, tensor-parallel shards at
    that; a parameter's state is its shards from the tp ranks' buffers, merged as the model's are.

    Under expert parallelism megatron-core chains two optimizers (keys ``chained_0.``, the dense
    parameters', data-parallel over ``dp``; ``chained_1.``, the experts', over ``dp / ep``): an
    expert-parallel rank's buffer holds its own experts (their tensor-parallel shards), as group
    ``tp_rank + tp * (ep_rank + ep * pp_rank)``, its rank in the expert tensor-expert-pipeline
    group (expert tensor parallelism equal to tp).

    An interleaved pipeline's stage holds one buffer per model chunk (``gbuf_idx`` = the chunk; the
    first chunk's bucketed by ``--ddp-bucket-size``, the others, as Megatron-LM builds them, not),
    chunk ``c`` of stage ``p`` holding the ``c * pp + p``-th piece of the layers."""

    def __init__(self, source, metadata):
        args = source.args
        self.source, self.metadata, self.tp = source, metadata, source.tensor_parallel_size
        self.ep = getattr(args, "expert_model_parallel_size", None) or 1
        self.names = names_for(source.family)
        _refuse_layouts(source, self.names)
        self._saved_sizes: dict[tuple[int, int], list] = {}  # (part, group) -> per_bucket_numel_unpadded
        self.chained = self.ep > 1  # the experts have buffers and an optimizer of their own
        self.vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
        model_dtype = self._find_buckets()
        self.dp = getattr(args, "data_parallel_size", None)
        if not self.dp:
            raise ConversionError(f"{source.directory}: args lack data_parallel_size, which the distributed "
                                  "optimizer's bucket padding depends on")
        self._layout_args = (bucket_size_of(args), bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False)),
                             shared_embedding_keys(source.config, source.pipeline_parallel_size))
        self.experts = {name: expert_shard_layout(name, source.layouts[name], source.config)
                        for name in source.layouts if self.names.expert_patterns and is_stacked_experts(name)}
        # (mega name, expert or None, tp rank) -> optimizer part, data-parallel group, buffer, bucket, range in it
        self.places: dict[tuple[str, int | None, int], tuple[int, int, int, int, int, int]] = {}
        self._place_all(self._held_at_places())
        groups = read_object(source.directory, metadata, self._key(0, 0, "optimizer/shard_0_1"))
        groups = groups[0]["param_groups"] if isinstance(groups, list) else groups["param_groups"]
        keys = ("exp_avg", "exp_avg_sq") + ((MAIN_PARAM,) if model_dtype != "torch.float32" else ())
        hyper = {k: groups[0][k] for k in ("lr", "betas", "eps", "weight_decay") if k in groups[0]}
        self.state = OptimizerState(
            keys=tuple(sorted(keys)), step=int(groups[0]["step"]), iteration=int(source.iteration or 0),
            consumed_samples=int(getattr(args, "consumed_train_samples", 0) or 0), hyperparameters=hyper)
        self._buckets: dict[tuple[int, int, int, str, int], torch.Tensor] = {}

    def _find_buckets(self) -> str:
        """Index the saved bucket tensors (``self.tensors``), checked to be the groups of this
        layout and of one dtype; returns the model's dtype."""
        where, tp = self.source.directory, self.tp
        pp, ep = self.source.pipeline_parallel_size, self.ep
        # (part, group, buffer, kind, bucket) -> checkpoint key
        self.tensors: dict[tuple[int, int, int, str, int], str] = {}
        dtypes = set()
        for key in self.metadata.state_dict_metadata:
            match = _BUCKET.fullmatch(key)
            if match:
                part, group, buffer, dtype, bucket, kind = match.groups()
                if int(buffer) >= self.vpp:
                    raise ConversionError(f"{where}: {key} is in a gradient buffer beyond the model chunks' "
                                          f"{self.vpp} (a model with parameters of two dtypes); mega reads one per "
                                          "chunk")
                dtypes.add(dtype)
                self.tensors[int(part or 0), int(group), int(buffer), kind, int(bucket)] = key
        expected = {(0, group) for group in range(tp * pp)} | \
            ({(1, group) for group in range(tp * ep * pp)} if self.chained else set())
        found = {(part, group) for part, group, _, _, _ in self.tensors}
        if found != expected:
            raise ConversionError(f"{where}: the distributed optimizer's state is saved for (optimizer, data-parallel "
                                  f"group) {sorted(found)}; a run at tp={tp}, pp={pp}, ep={ep} has {sorted(expected)}")
        if len(dtypes) != 1:
            raise ConversionError(f"{where}: the distributed optimizer's buckets have dtypes {sorted(dtypes)}")
        return dtypes.pop().strip("()").split(",")[0].strip()

    def _held_at_places(self) -> dict[tuple[int, int], list[tuple[str, str, int | None, int]]]:
        """(name in the chunk's model, mega name, expert or None, elements on a tp rank) of each
        place's parameters; a place is (pipeline stage, model chunk), in virtual-stage order."""
        source, tp, names = self.source, self.tp, self.names
        layers = chunk_layers(source.args, source.config.num_layers, source.pipeline_parallel_size, self.vpp)
        virtual = sorted(layers, key=lambda place: (place[1], place[0]))
        tied = not source.config.untie_embeddings_and_output_weights
        at_place: dict[tuple[int, int], list[tuple[str, str, int | None, int]]] = {place: [] for place in virtual}
        for name, layout in source.layouts.items():
            for index, local_name in stage_of(name, [layers[place] for place in virtual], tied, names.stacks[0]):
                held = at_place[virtual[index]]
                if name in self.experts:  # a parameter per expert, as megatron-core's experts hold them
                    prefix, _, part = local_name.rpartition("mlp.experts.")
                    numel = math.prod(self.experts[name].local_shape(tp))
                    held += [(f"{prefix}{names.expert_file_name.format(expert=expert, part=part)}", name, expert,
                              numel) for expert in range(layout.shape[0])]
                else:
                    held.append((local_name, name, None, math.prod(layout.local_shape(tp))))
        return at_place

    def _place_all(self, at_place: dict[tuple[int, int], list[tuple[str, str, int | None, int]]]) -> None:
        """Each place's parameters in megatron-core's order, placed in the buffers of their groups:
        the dense ones (all of them without expert parallelism), then each expert rank's experts."""
        tp, ep, dp = self.tp, self.ep, self.dp
        order = ORDERS[self.source.family]
        local_experts = max((self.source.layouts[name].shape[0] for name in self.experts), default=ep) // ep
        for (stage, chunk), held in at_place.items():
            held.sort(key=lambda entry: order.key(entry[0]))
            where_held = f"pipeline stage {stage}" + (f", model chunk {chunk}" if self.vpp > 1 else "")
            dense = [entry for entry in held if entry[2] is None] if self.chained else held
            self._place(0, chunk, dense, [rank + tp * stage for rank in range(tp)], dp, where_held)
            for expert_rank in range(ep if self.chained else 0):
                mine = [entry for entry in held if entry[2] is not None and entry[2] // local_experts == expert_rank]
                self._place(1, chunk, mine, [rank + tp * (expert_rank + ep * stage) for rank in range(tp)], dp // ep,
                            f"expert-parallel rank {expert_rank}, {where_held}")

    def _key(self, part: int, group: int, name: str) -> str:
        return (f"chained_{part}." if self.chained else "") + f"optimizer.distributed.dp_group_idx_{group}.{name}"

    def _place(self, part: int, chunk: int, held: list, groups: list[int], dp: int, what: str) -> None:
        """Where ``held`` (a model chunk's parameters in order) lie in buffer ``chunk`` of ``groups``
        (one per tp rank) of optimizer ``part``, checked against the saved bucket sizes."""
        bucket_size, high_nccl_busbw, own_bucket = self._layout_args
        bucket_size = bucket_size if chunk == 0 else None  # Megatron-LM disables later chunks' bucketing
        places, built = buffer_layout([(entry[0], entry[3]) for entry in held], dp, bucket_size, high_nccl_busbw,
                                      own_bucket)
        for rank, group in enumerate(groups):
            saved = self._bucket_sizes(part, group, chunk)
            if built != saved:
                raise ConversionError(
                    f"{self.source.directory}: megatron-core's gradient buffer of tp rank {rank}, {what} for these args "
                    f"(dp {dp}, bucket size {bucket_size}) has buckets of {built} elements, but the checkpoint's "
                    f"per_bucket_numel_unpadded says {saved}; the args and the state disagree")
            for stage_name, name, expert, _ in held:  # the first stage's copy of a tied embedding
                self.places.setdefault((name, expert, rank), (part, group, chunk, *places[stage_name]))

    def _bucket_sizes(self, part: int, group: int, chunk: int) -> list[int]:
        where = self.source.directory
        # [[buffer...]]: {(param dtype, grad dtype): each bucket's size} per gradient buffer (gbuf_idx),
        # read once per group (every model chunk's buffer is in it)
        if (part, group) not in self._saved_sizes:
            self._saved_sizes[part, group] = read_object(
                where, self.metadata, self._key(part, group, "per_bucket_numel_unpadded/shard_0_1"))
        saved = self._saved_sizes[part, group]
        try:
            (sizes,) = [buffer for buffers in saved for buffer in buffers][chunk].values()
        except (TypeError, ValueError, AttributeError, IndexError, KeyError):
            raise ConversionError(f"{where}: the distributed optimizer's per_bucket_numel_unpadded is {saved!r}, "
                                  f"not one buffer of one dtype for model chunk {chunk}") from None
        return list(sizes)

    def get(self, name: str, key: str) -> torch.Tensor:
        kind = {mega: megatron for megatron, mega in TO_MEGA.items()}[key]
        if name in self.experts:  # stacked as the weights are
            return torch.stack([self._merged(name, expert, kind, self.experts[name])
                                for expert in range(self.source.layouts[name].shape[0])])
        return self._merged(name, None, kind, self.source.layouts[name])

    def _merged(self, name: str, expert: int | None, kind: str, layout) -> torch.Tensor:
        """One parameter's ``kind`` from the tp ranks' buffers, merged as the weights are."""
        shards = []
        for rank in range(self.tp if layout.dim is not None else 1):  # a whole tensor: any rank's copy
            part, group, buffer, bucket, start, end = self.places[name, expert, rank]
            held = (part, group, buffer, kind, bucket)
            if held not in self._buckets:
                stored = self.tensors[held]
                self._buckets[held] = self.source._read(stored, None, {stored: self.metadata.state_dict_metadata[stored]})
            shards.append(self._buckets[held][start:end].view(layout.local_shape(self.tp)))
        return layout.merge(shards).clone()


DISTRIB_OPTIM_FILE = "distrib_optim.pt"


def bucket_size_of(args) -> int | None:
    """DDP's bucket size for a run's args (None: one bucket, without --overlap-grad-reduce)."""
    if not getattr(args, "overlap_grad_reduce", False):
        return None
    return getattr(args, "ddp_bucket_size", None) or max(40_000_000, 1_000_000 * args.data_parallel_size)


def read_distrib_optim(rank_file: Path, state: dict, parameters: list[tuple[str, torch.Tensor]], args,
                       own_bucket: frozenset[str], chunks: int, is_expert):
    """(model key -> {mega key: tensor}, step, group 0's hyperparameters) of one legacy rank:
    ``state`` its model_optim_rng.pt, ``parameters`` its model's (key, tensor) in order, keys behind
    their model chunk's name (``model.``, or ``model0.``, ``model1.``... of ``chunks``), ``own_bucket``
    the keys with a bucket each (:func:`shared_embedding_keys`). Chunk ``c``'s parameters are
    gradient buffer ``c``, bucketed as DDP buckets the first chunk only. Under expert parallelism
    the file holds megatron-core's chained pair (a list): the dense parameters' buffers (data-parallel
    over dp; None but in expert-parallel rank 0's files) and this rank's experts' (``is_expert(key)``;
    over dp / ep)."""
    path = rank_file.parent / DISTRIB_OPTIM_FILE
    saved = load_megatron_pickle(path)
    dp = getattr(args, "data_parallel_size", None)
    if not dp:
        raise ConversionError(f"{rank_file}: args lack data_parallel_size, which the buffer layout depends on")
    ep = getattr(args, "expert_model_parallel_size", None) or 1
    found = {}
    for part, (part_state, held) in enumerate(chained_parts(saved, parameters, is_expert, str(path))):
        if part_state is not None:  # the dense state is in expert-parallel rank 0's files only
            part_dp = dp // ep if part else dp  # the experts are data-parallel over dp / ep
            found.update(_read_buffers(path, rank_file, part_state, held, part_dp, args, own_bucket, chunks))
    step_of = state.get("optimizer") or {}
    step_of = step_of[0] if isinstance(step_of, list) and step_of else step_of  # a chained pair's first
    groups = step_of.get("optimizer", {}).get("param_groups") or [{}]
    if "step" not in groups[0]:
        raise ConversionError(f"{rank_file}: the distributed optimizer's param groups hold no step")
    hyper = {k: groups[0][k] for k in ("lr", "betas", "eps", "weight_decay") if k in groups[0]}
    return found, int(groups[0]["step"]), hyper


def _read_buffers(path: Path, rank_file: Path, saved, parameters: list[tuple[str, torch.Tensor]], dp: int, args,
                  own_bucket: frozenset[str], chunks: int) -> dict[str, dict[str, torch.Tensor]]:
    """One optimizer's buffers of a ``distrib_optim.pt`` (``saved``: buffer -> dtype -> kind ->
    flat tensor), cut into ``parameters``' state (model key -> {mega key: tensor})."""
    buffers = sorted(key for key in saved if isinstance(key, int)) if isinstance(saved, dict) else None
    if buffers != list(range(chunks)):
        raise ConversionError(f"{path} holds the gradient buffers {buffers if buffers is not None else type(saved)}, "
                              f"not one per model chunk (0 to {chunks - 1}): a second dtype's are not read")
    found = {}
    for chunk in range(chunks):
        try:
            ((dtype, tensors),) = saved[chunk].items()
            numel = int(tensors["numel_unpadded"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ConversionError(f"{path} does not hold gradient buffer {chunk}'s state (megatron-core's "
                                  "save_parameter_state of a model with one dtype)") from None
        prefix = "model." if chunks == 1 else f"model{chunk}."
        held = [(key, tensor) for key, tensor in parameters if key.startswith(prefix)]
        bucket_size = bucket_size_of(args) if chunk == 0 else None  # Megatron-LM buckets the first chunk only
        places, sizes = buffer_layout([(key, tensor.numel()) for key, tensor in held], dp, bucket_size,
                                      bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False)), own_bucket)
        if sum(sizes) != numel:
            raise ConversionError(f"{path}: megatron-core's gradient buffer for {rank_file.name}'s parameters and "
                                  f"these args (dp {dp}, bucket size {bucket_size}) has {sum(sizes)} elements, but "
                                  f"the file's numel_unpadded is {numel}; the args and the state disagree")
        offsets = [sum(sizes[:bucket]) for bucket in range(len(sizes))]
        kinds = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
        if dtype[0] != torch.float32:  # the fp32 main parameters of a bf16/fp16 run
            kinds[MAIN_PARAM] = "param"
        for key, tensor in held:
            bucket, start, end = places[key]
            found[key] = {mega: tensors[kind][offsets[bucket] + start:offsets[bucket] + end].view(tensor.shape)
                          for mega, kind in kinds.items()}
    return found
