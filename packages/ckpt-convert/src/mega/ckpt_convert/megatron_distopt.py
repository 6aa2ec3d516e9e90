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
``per_bucket_numel_unpadded``, or the import stops naming both. Read for one tensor- and
pipeline-parallel rank (tp = pp = 1) of dense GPT and LLaMA models; other layouts are refused.

Legacy files (``--ckpt-format torch``) keep the same state per tensor x pipeline rank in
``distrib_optim.pt`` beside ``model_optim_rng.pt`` (``save_parameter_state``): per buffer and
dtype, one flat tensor per kind of every bucket's elements one after the other (padding between
buckets left out), ``numel_unpadded`` their total; the step is in ``model_optim_rng.pt``'s
``optimizer.optimizer.param_groups``. There the parameters are the rank file's model state dict's,
in its order, so any tensor-parallel size reads; one pipeline stage (no shared-embedding bucket).
"""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.megatron_legacy_optimizer import megatron_order
from mega.ckpt_convert.megatron_pickle import load_megatron_pickle
from mega.ckpt_convert.optimizer_state import MAIN_PARAM, OptimizerState

GROUP = "optimizer.distributed.dp_group_idx_0."
_BUCKET = re.compile(re.escape(GROUP) + r"gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)")
TO_MEGA = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "param": MAIN_PARAM}
PARAM_ALIGNMENT = 64  # elements: megatron-core starts every parameter 128-byte aligned


def _ceil(number: int, divisor: int) -> int:
    return math.ceil(number / divisor) * divisor


def buffer_layout(params: list[tuple[str, int]], dp: int, bucket_size: int | None,
                  high_nccl_busbw: bool) -> tuple[dict[str, tuple[int, int, int]], list[int]]:
    """(name -> (bucket, start, end) within the bucket, each bucket's unpadded size) of the gradient
    buffer megatron-core builds for ``params`` ((name, elements) in model order)."""
    divisor = math.lcm(dp, 128, 2**16) if high_nccl_busbw else math.lcm(dp, 128)
    places, sizes = {}, []
    start = bucket_start = held = 0
    end = 0
    for name, numel in reversed(params):  # backprop order
        start = _ceil(start, PARAM_ALIGNMENT)
        end = start + numel
        places[name] = (len(sizes), start - bucket_start, end - bucket_start)
        held += 1
        if bucket_size is not None and end - bucket_start >= bucket_size:
            sizes.append(end - bucket_start)
            start = bucket_start = _ceil(end, divisor)
            held = 0
        else:
            start = end
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


class BufferOptimizer:
    """The dp_reshardable state of a torch_dist ``source``, per parameter: ``state`` and ``get``."""

    def __init__(self, source, metadata):
        where, args = source.directory, source.args
        tp, pp = source.tensor_parallel_size, source.pipeline_parallel_size
        if (tp, pp) != (1, 1) or source.family not in ("gpt", "llama"):
            raise ConversionError(
                f"--with-optimizer: {where} holds the distributed optimizer's dp_reshardable state of a "
                f"{source.family} run at tp={tp}, pp={pp}; mega reads it for GPT and LLaMA runs at tp=pp=1: "
                "save the run with --dist-ckpt-optim-fully-reshardable, or convert without --with-optimizer")
        self.source, self.metadata = source, metadata
        self.tensors: dict[tuple[str, int], str] = {}  # (kind, bucket) -> checkpoint key
        dtypes = set()
        for key in metadata.state_dict_metadata:
            match = _BUCKET.fullmatch(key)
            if match:
                buffer, dtype, bucket, kind = match.groups()
                if buffer != "0":
                    raise ConversionError(f"{where}: {key} is in a second gradient buffer (a model with "
                                          "parameters of two dtypes, or experts); mega reads one buffer's")
                dtypes.add(dtype)
                self.tensors[kind, int(bucket)] = key
        if len(dtypes) != 1:
            raise ConversionError(f"{where}: the distributed optimizer's buckets have dtypes {sorted(dtypes)}")
        # [model chunk][buffer] -> {(param dtype, grad dtype): each bucket's size}
        saved_sizes = read_object(where, metadata, GROUP + "per_bucket_numel_unpadded/shard_0_1")
        try:
            ((buffer,),) = saved_sizes
            (sizes,) = buffer.values()
        except (TypeError, ValueError, AttributeError):
            raise ConversionError(f"{where}: the distributed optimizer's per_bucket_numel_unpadded is {saved_sizes!r}, "
                                  "not one model chunk's one buffer (mega reads runs without interleaving)") from None
        dp = getattr(args, "data_parallel_size", None)
        if not dp:
            raise ConversionError(f"{where}: args lack data_parallel_size, which the distributed optimizer's "
                                  "bucket padding depends on")
        bucket_size = bucket_size_of(args)
        params = sorted(source.layouts, key=megatron_order)
        numels = [(name, math.prod(source.layouts[name].shape)) for name in params]
        self.places, built = buffer_layout(numels, dp, bucket_size,
                                           bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False)))
        if built != list(sizes):
            raise ConversionError(f"{where}: megatron-core's gradient buffer for these args (dp {dp}, bucket size "
                                  f"{bucket_size}) has buckets of {built} elements, but the checkpoint's "
                                  f"per_bucket_numel_unpadded says {list(sizes)}; the args and the state disagree")
        groups = read_object(where, metadata, GROUP + "optimizer/shard_0_1")
        groups = groups[0]["param_groups"] if isinstance(groups, list) else groups["param_groups"]
        model_dtype = dtypes.pop().strip("()").split(",")[0].strip()
        keys = ("exp_avg", "exp_avg_sq") + ((MAIN_PARAM,) if model_dtype != "torch.float32" else ())
        hyper = {k: groups[0][k] for k in ("lr", "betas", "eps", "weight_decay") if k in groups[0]}
        self.state = OptimizerState(
            keys=tuple(sorted(keys)), step=int(groups[0]["step"]), iteration=int(source.iteration or 0),
            consumed_samples=int(getattr(args, "consumed_train_samples", 0) or 0), hyperparameters=hyper)
        self._buckets: dict[tuple[str, int], torch.Tensor] = {}

    def get(self, name: str, key: str) -> torch.Tensor:
        kind = {mega: megatron for megatron, mega in TO_MEGA.items()}[key]
        bucket, start, end = self.places[name]
        if (kind, bucket) not in self._buckets:
            stored = self.tensors[kind, bucket]
            self._buckets[kind, bucket] = self.source._read(stored, None, {stored: self.metadata.state_dict_metadata[stored]})
        return self._buckets[kind, bucket][start:end].view(self.source.layouts[name].shape).clone()


DISTRIB_OPTIM_FILE = "distrib_optim.pt"


def bucket_size_of(args) -> int | None:
    """DDP's bucket size for a run's args (None: one bucket, without --overlap-grad-reduce)."""
    if not getattr(args, "overlap_grad_reduce", False):
        return None
    return getattr(args, "ddp_bucket_size", None) or max(40_000_000, 1_000_000 * args.data_parallel_size)


def read_distrib_optim(rank_file: Path, state: dict, parameters: list[tuple[str, torch.Tensor]], args):
    """(model key -> {mega key: tensor}, step, group 0's hyperparameters) of one legacy rank:
    ``state`` its model_optim_rng.pt, ``parameters`` its model's (key, tensor) in order."""
    path = rank_file.parent / DISTRIB_OPTIM_FILE
    saved = load_megatron_pickle(path)
    try:
        ((dtype, tensors),) = saved[0].items()
        numel = int(tensors["numel_unpadded"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ConversionError(f"{path} does not hold one gradient buffer's state (megatron-core's "
                              "save_parameter_state of a model with one dtype)") from None
    if 1 in saved:
        raise ConversionError(f"{path} holds a second gradient buffer (experts, or two dtypes); mega reads one's")
    dp = getattr(args, "data_parallel_size", None)
    if not dp:
        raise ConversionError(f"{rank_file}: args lack data_parallel_size, which the buffer layout depends on")
    places, sizes = buffer_layout([(key, tensor.numel()) for key, tensor in parameters], dp, bucket_size_of(args),
                                  bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False)))
    if sum(sizes) != numel:
        raise ConversionError(f"{path}: megatron-core's gradient buffer for {rank_file.name}'s parameters and these "
                              f"args (dp {dp}, bucket size {bucket_size_of(args)}) has {sum(sizes)} elements, but "
                              f"the file's numel_unpadded is {numel}; the args and the state disagree")
    offsets = [sum(sizes[:bucket]) for bucket in range(len(sizes))]
    kinds = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    if dtype[0] != torch.float32:  # the fp32 main parameters of a bf16/fp16 run
        kinds[MAIN_PARAM] = "param"
    found = {}
    for key, tensor in parameters:
        bucket, start, end = places[key]
        found[key] = {mega: tensors[kind][offsets[bucket] + start:offsets[bucket] + end].view(tensor.shape)
                      for mega, kind in kinds.items()}
    groups = (state.get("optimizer") or {}).get("optimizer", {}).get("param_groups") or [{}]
    if "step" not in groups[0]:
        raise ConversionError(f"{rank_file}: the distributed optimizer's param groups hold no step")
    hyper = {k: groups[0][k] for k in ("lr", "betas", "eps", "weight_decay") if k in groups[0]}
    return found, int(groups[0]["step"]), hyper
