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
        bucket_size = None
        if getattr(args, "overlap_grad_reduce", False):
            bucket_size = getattr(args, "ddp_bucket_size", None) or max(40_000_000, 1_000_000 * dp)
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
