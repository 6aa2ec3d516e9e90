"""``--quantization KIND``: the loaded model's linear weights quantized by the setup pass a plugin
registers under the name ``quantization`` (mega-torchao's: int8, fp8, int4), run at its phase
(``PRECISION``) once the weights are in and an adapter is merged; and the weight bytes before
and after, which ``mega generate``, ``serve`` and ``eval`` print.

The pass is made before any weight is loaded (:func:`quantization_pass`), so a kind the device
cannot run is refused at once; the plugin says why.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mega.core.config import ConfigError
from mega.core.parallel import ParallelGroups
from mega.core.plugins import PluginError
from mega.core.setup_passes import ModelSetup, SetupPass, run_setup

QUANTIZATION_PASS = "quantization"  # the registered setup pass name this module asks for


class QuantizationError(RuntimeError):
    """``--quantization`` cannot be used here; the message says why."""


@dataclass(frozen=True)
class QuantizationRequest:
    """What the registered pass's factory is given: the kind, and where and in what dtype the model runs."""

    quantization: str
    device: torch.device
    dtype: torch.dtype


@dataclass(frozen=True)
class WeightBytes:
    """This rank's parameter bytes before and after quantization."""

    kind: str
    before: int
    after: int

    def describe(self) -> str:
        mib = 1 << 20
        return (f"--quantization {self.kind}: weights {self.before / mib:.2f} MiB -> {self.after / mib:.2f} MiB "
                f"({self.after / self.before:.2f}x) on this rank")


def quantization_pass(request: QuantizationRequest, plugins) -> SetupPass:
    """The registered ``quantization`` pass made for ``request``; :class:`QuantizationError` when no
    plugin provides it or the plugin refuses the kind on this device."""
    try:
        factory = plugins.setup_passes.get(QUANTIZATION_PASS)
    except PluginError as error:
        raise QuantizationError(f"--quantization needs a plugin that registers the {QUANTIZATION_PASS!r} setup pass "
                                f"(pip install mega-torchao): {error}") from None
    try:
        setup_pass = factory(request)
    except ConfigError as error:
        raise QuantizationError(f"--quantization {request.quantization}: {error}") from None
    if setup_pass is None:
        raise QuantizationError(f"--quantization {request.quantization}: the {QUANTIZATION_PASS!r} setup pass declined it")
    return setup_pass


def quantize(model: nn.Module, setup_pass: SetupPass, request: QuantizationRequest, family, config,
             groups: ParallelGroups) -> tuple[nn.Module, WeightBytes]:
    """Run ``setup_pass`` over the loaded ``model``; the model (the pass may replace it) and its bytes."""
    before = weight_bytes(model)
    setup = ModelSetup([model], family, config, groups, groups.config, training=False, device=request.device,
                       dtype=request.dtype, init=False, run=request)
    try:
        [model] = run_setup(setup, [setup_pass])
    except ConfigError as error:
        raise QuantizationError(f"--quantization {request.quantization}: {error}") from None
    return model, WeightBytes(request.quantization, before, weight_bytes(model))


def weight_bytes(model: nn.Module) -> int:
    """The bytes ``model``'s parameters hold on this rank, each tensor once (tied weights), a
    quantized tensor subclass by the tensors it holds (its data, scales, zero points)."""
    return sum(tensor_bytes(param) for param in {id(p): p for p in model.parameters()}.values())


def tensor_bytes(tensor: torch.Tensor) -> int:
    if hasattr(type(tensor), "__tensor_flatten__"):  # a wrapper subclass (torchao's quantized tensors)
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()
