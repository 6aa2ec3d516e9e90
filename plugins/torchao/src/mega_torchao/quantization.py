"""Weight-only quantization of a loaded model for inference (``mega generate|serve|eval
--quantization int8|fp8|int4``): :func:`quantization_pass` is the setup pass of phase
``PRECISION`` (:mod:`mega.core.setup_passes`) that puts the model's linear layers on torchao's
quantized weight tensors, run by mega-inference once the weights are in (and an adapter merged).

The kinds, by the device the model runs on (a kind a device cannot run is refused by name):

* ``int8``: torchao's ``Int8WeightOnlyConfig``: int8 weights, one symmetric scale per output row,
  the product in the activation dtype. Any device.
* ``fp8``: on a GPU of compute capability 8.9+, ``Float8DynamicActivationFloat8WeightConfig``:
  E4M3 weights and activations (their scales computed as they come), products on
  ``torch._scaled_mm``; scales per row (activations: per token) on 9.0+, per tensor on 8.9. On the CPU
  ``Float8WeightOnlyConfig``: E4M3 weights with per-row scales, dequantized into the product
  (the accuracy of FP8 weights, not their speed). Older GPUs are refused (no FP8 products).
* ``int4``: groups of 128 input features (64 or 32 where 128 does not divide a layer's) with a
  scale and zero point each. CUDA: ``Int4WeightOnlyConfig`` in the ``tile_packed_to_4d`` layout
  (the tinygemm kernel: bfloat16 activations, compute capability 8.0+); CPU: torchao's
  ``PrototypeInt4WeightOnlyConfig`` (``Int4OpaqueTensor``, ATen's int4 CPU kernel).

Kept in the model's dtype, as the FP8 training pass keeps them: the output layer and the MoE
router; MoE experts stored as grouped weights are not linear layers and stay too.

Tensor parallelism: each rank quantizes its shards. An int8 row-parallel shard (input features
split) takes its rows' scales from the whole row (the shards' scales reduced MAX over the tensor
group), so its int8 values are the slices of one process's; an int4 group lies inside a shard,
so int4 shards are the one-process values as they are. FP8 scales cover the shard's part of a
row (as fine or finer than one process's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mega.core.config import ConfigError
from mega.core.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mega.core.plugins import get_plugins
from mega.core.setup_passes import ModelSetup, Phase, SetupPass
from mega_torchao.fp8 import HIGHER_PRECISION

KINDS = ("int8", "fp8", "int4")
INT4_GROUP_SIZES = (128, 64, 32)  # the largest that divides a layer's input features
FP8_PRODUCTS = (8, 9)  # torch._scaled_mm on a GPU
FP8_ROWWISE = (9, 0)
INT4_CUDA = (8, 0)  # torchao's tinygemm kernel


def device_capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability (a function of its own so tests can name another GPU)."""
    return tuple(torch.cuda.get_device_capability(device))


@dataclass(frozen=True)
class Plan:
    """What one kind does on one device: torchao's config per int4 group size (one config otherwise)."""

    kind: str
    device: torch.device
    dtype: torch.dtype

    def config(self, group_size: int | None = None):
        # optional dependency: the plugin's backend reports a missing torchao
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            Float8WeightOnlyConfig,
            Int4WeightOnlyConfig,
            Int8WeightOnlyConfig,
            PerRow,
            PerTensor,
        )

        cuda = self.device.type == "cuda"
        if self.kind == "int8":
            return Int8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)
        if self.kind == "fp8":
            if not cuda:
                return Float8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)
            rowwise = device_capability(self.device) >= FP8_ROWWISE
            return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow() if rowwise else PerTensor(),
                                                             set_inductor_config=False)
        if cuda:
            return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d",
                                        set_inductor_config=False)
        # optional dependency, as above (torchao's CPU int4 layout is a prototype in 0.18)
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False)


def plan(kind: str, device: torch.device, dtype: torch.dtype) -> Plan:
    """The plan for ``kind`` on ``device`` at ``dtype``; a kind the device cannot run raises
    :class:`ConfigError` saying why."""
    if kind not in KINDS:
        raise ConfigError(f"unknown kind {kind!r}: mega-torchao quantizes weights as {', '.join(KINDS)}")
    if not dtype.is_floating_point:
        raise ConfigError(f"{kind} quantizes floating-point weights, the model is {dtype}")
    if device.type == "cuda":
        have = device_capability(device)
        gpu = f"this GPU is compute capability {have[0]}.{have[1]}"
        if kind == "fp8" and have < FP8_PRODUCTS:
            raise ConfigError(f"fp8 needs a GPU of compute capability 8.9+ for its FP8 products (torch._scaled_mm); "
                              f"{gpu}: use int8 (the same bytes per weight)")
        if kind == "int4" and have < INT4_CUDA:
            raise ConfigError(f"int4 runs torchao's tinygemm kernel, which needs compute capability 8.0+; {gpu}")
        if kind == "int4" and dtype != torch.bfloat16:
            raise ConfigError(f"int4 on CUDA runs torchao's tinygemm kernel, which computes in bfloat16: "
                              f"give --dtype bfloat16 (the model is {str(dtype).removeprefix('torch.')})")
    elif device.type != "cpu":
        raise ConfigError(f"{kind} runs on CUDA or the CPU (torchao's layouts), not on {device.type}")
    return Plan(kind, device, dtype)


def quantizable_layers(module: nn.Module) -> tuple[dict[str, nn.Module], list[str]]:
    """The linear layers to quantize (``nn.Linear``, mega's column/row-parallel ones) by name,
    and the names of those kept in the model's dtype (the output layer, the router)."""
    chosen, kept = {}, []
    for name, layer in module.named_modules():
        if not isinstance(layer, (nn.Linear, ColumnParallelLinear, RowParallelLinear)):
            continue
        if HIGHER_PRECISION.search(name) or not layer.weight.is_floating_point() or layer.weight.dim() != 2:
            kept.append(name)
        else:
            chosen[name] = layer
    return chosen, kept


def int4_group_size(name: str, layer: nn.Module) -> int:
    features = layer.weight.shape[1]
    for size in INT4_GROUP_SIZES:
        if features % size == 0:
            return size
    raise ConfigError(f"int4 quantizes groups of {', '.join(map(str, INT4_GROUP_SIZES))} input features; {name} has "
                      f"{features} (on this rank): choose int8 or fp8, or a tensor-parallel size that leaves a "
                      "multiple of 32")


@dataclass
class QuantizationReport:
    """What the pass did: the layers quantized and those kept, by module name."""

    kind: str
    quantized: list[str]
    kept: list[str]


def quantize_weights(module: nn.Module, plan: Plan, tp=None) -> QuantizationReport:
    """Quantize ``module``'s linear layers in place as ``plan`` says, through torchao's
    ``quantize_`` (int8 row-parallel shards of a tensor group ``tp`` of 2+ with their rows'
    whole scales, see the module docstring). A module with no linear layer to quantize raises."""
    # optional dependency, as above
    from torchao.quantization import quantize_

    chosen, kept = quantizable_layers(module)
    if not chosen:
        why = f" (kept in the model's dtype: {', '.join(kept)})" if kept else ""
        raise ConfigError(f"{plan.kind}: the model has no linear layer to quantize{why}")
    by_config: dict[int | None, set[str]] = {}
    for name, layer in chosen.items():
        if plan.kind == "int8" and isinstance(layer, RowParallelLinear) and tp is not None and tp.size > 1:
            _int8_with_whole_row_scales(layer, tp)
            continue
        group_size = int4_group_size(name, layer) if plan.kind == "int4" else None
        by_config.setdefault(group_size, set()).add(name)
    for group_size, names in sorted(by_config.items(), key=lambda item: item[0] or 0):
        quantize_(module, plan.config(group_size), filter_fn=lambda layer, name, names=names: name in names)
    return QuantizationReport(plan.kind, sorted(chosen), kept)


@torch.no_grad()
def _int8_with_whole_row_scales(layer: RowParallelLinear, tp) -> None:
    """torchao's int8 weight-only tensor of this rank's shard with the scales of the whole rows:
    a symmetric scale is the row's largest magnitude over a constant, so the MAX over the shards'
    scales is the whole row's, bit for bit."""
    # optional dependency, as above
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    from mega.core.parallel.collectives import all_reduce

    scale = Int8Tensor.from_hp(layer.weight, PerRow()).scale.clone()
    all_reduce(scale, tp, op=torch.distributed.ReduceOp.MAX)
    layer.weight = nn.Parameter(Int8Tensor.from_hp(layer.weight, PerRow(), scale=scale), requires_grad=False)


class QuantizationPass:
    """The pass over a loaded model's chunks; ``reports`` says what it did to each."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.reports: list[QuantizationReport] = []

    def __call__(self, setup: ModelSetup) -> None:
        for chunk in setup.chunks:
            self.reports.append(quantize_weights(chunk, self.plan, setup.groups.tp))


def quantization_pass(run_config) -> SetupPass | None:
    """The quantization pass a run asks for with ``run_config.quantization`` (a kind; the
    inference loader's request also names ``device`` and ``dtype``); None for a run without it
    (every training run). A kind the device cannot run raises :class:`ConfigError` now, before
    any weight is loaded."""
    kind = getattr(run_config, "quantization", None)
    if kind is None:
        return None
    available, missing = get_plugins().kernel_backends.get("torchao").is_available()
    if not available:
        raise ConfigError(f"--quantization {kind}: {missing}")
    chunk_pass = QuantizationPass(plan(kind, torch.device(run_config.device), run_config.dtype))
    return SetupPass("quantization", Phase.PRECISION, chunk_pass,
                     f"weight-only {kind} quantization of the linear layers (torchao)")
