"""The FP8 pass: :func:`apply_fp8` puts the linear layers of a built model chunk on torchao's FP8
products, and :func:`fp8_pass` runs it on every chunk of a run that asks for
``--fp8-format e4m3|hybrid --fp8-recipe tensorwise|rowwise``: a setup pass of phase ``PRECISION``
(:mod:`mega.core.setup_passes`), after the adapters (LoRA's are converted too), before recompute,
compile and data parallelism.

Kept in higher precision, as Megatron keeps them: the output layer (the logits), the MoE router
(its softmax picks experts), and with ``--first-last-layers-bf16`` the first
``--num-layers-at-start-in-bf16`` and last ``--num-layers-at-end-in-bf16`` transformer layers.
Layers are swapped for FP8 ones holding the same parameter objects, so names, checkpoints
(FP8 scales are computed per step: there is no FP8 state to save) and the data-parallel buffers
are unchanged: a checkpoint of an FP8 run loads in a bf16 run and back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from mega.core.config import ConfigError
from mega.core.fp8_recipes import fp8_backend
from mega.core.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mega.core.plugins import get_plugins
from mega.core.setup_passes import ModelSetup, Phase, SetupPass, per_chunk
from mega_torchao.backend import MIN_CAPABILITY, RECIPES

HIGHER_PRECISION = re.compile(r"(^|\.)(output_layer|router)$")
LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def float8_config(fp8_format: str, recipe: str):
    """torchao's ``Float8LinearConfig`` for Megatron's format and the recipe: ``tensorwise``
    (one scale per tensor) or ``rowwise`` (one per row, powers of two); ``hybrid`` casts the
    gradients to E5M2, ``e4m3`` to E4M3."""
    # optional dependency: the kernel library may be absent; the backend reports it
    from torchao.float8.config import CastConfig, Float8LinearConfig, e4m3_dtype, e5m2_dtype

    config = Float8LinearConfig.from_recipe_name(recipe)
    grad_dtype = e5m2_dtype if fp8_format == "hybrid" else e4m3_dtype
    grad = config.cast_config_grad_output
    return Float8LinearConfig(
        cast_config_input=config.cast_config_input, cast_config_weight=config.cast_config_weight,
        cast_config_grad_output=CastConfig(scaling_type=grad.scaling_type,
                                           scaling_granularity=grad.scaling_granularity, target_dtype=grad_dtype),
        round_scales_to_power_of_2=config.round_scales_to_power_of_2)


@dataclass
class FP8Report:
    """What the pass did, by module name."""

    fp8: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def apply_fp8(stage: nn.Module, config, *, num_layers: int, layers_at_start: int = 0,
              layers_at_end: int = 0, defer_weight_grads: bool = False) -> FP8Report:
    """Swap ``stage``'s linear layers (``nn.Linear``, mega's column/row-parallel ones) for FP8
    ones under torchao's ``config``, in place, but for the output layer, the router and the
    first ``layers_at_start`` / last ``layers_at_end`` of ``num_layers`` transformer layers.
    ``defer_weight_grads`` (a zero-bubble schedule): an ``nn.Linear`` becomes mega's
    ``Float8DeferringLinear`` (the same numbers, W at the W step) instead of torchao's ``Float8Linear``."""
    # optional dependency, as above
    from torchao.float8.float8_linear import Float8Linear

    from mega_torchao.layers import Float8ColumnParallelLinear, Float8DeferringLinear, Float8RowParallelLinear

    report = FP8Report()
    for name, module in list(stage.named_modules()):
        kinds = {ColumnParallelLinear: Float8ColumnParallelLinear.from_parallel,
                 RowParallelLinear: Float8RowParallelLinear.from_parallel}
        if type(module) in kinds:
            convert = kinds[type(module)]
        elif isinstance(module, nn.Linear) and not isinstance(module, (Float8Linear, Float8DeferringLinear)):
            convert = Float8DeferringLinear.from_linear if defer_weight_grads else _from_linear(Float8Linear)
        else:
            continue
        number = LAYER_NUMBER.search(name + ".")
        outer = number is not None and not layers_at_start <= int(number.group(1)) < num_layers - layers_at_end
        if HIGHER_PRECISION.search(name) or outer:
            report.kept.append(name)
            continue
        parent, _, child = name.rpartition(".")
        setattr(stage.get_submodule(parent), child, convert(module, config))
        report.fp8.append(name)
    return report


def _from_linear(float8_linear):
    def convert(module: nn.Linear, config):
        new = float8_linear.from_float(module, config)  # holds module's parameters
        new._forward_hooks.update(module._forward_hooks)
        new._forward_pre_hooks.update(module._forward_pre_hooks)
        return new

    return convert


def check_device(device: torch.device, recipe: str) -> None:
    """FP8 products need torch._scaled_mm: any CPU, or a GPU of the recipe's compute capability."""
    if device.type != "cuda":
        return
    need = MIN_CAPABILITY[recipe]
    have = torch.cuda.get_device_capability(device)
    if tuple(have) < need:
        raise ConfigError(f"--fp8-recipe {recipe} needs a GPU of compute capability >= {need[0]}.{need[1]} "
                          f"(torch._scaled_mm), this {torch.cuda.get_device_name(device)} is {have[0]}.{have[1]}")


class FP8Pass:
    """The pass over one chunk: :func:`apply_fp8` with the run's precision flags; ``reports`` what it did."""

    def __init__(self, precision, num_layers: int, defer_weight_grads: bool = False):
        self.config = float8_config(precision.fp8, precision.fp8_recipe)
        self.defer_weight_grads = defer_weight_grads
        self.recipe, self.num_layers = precision.fp8_recipe, num_layers
        outer = precision.first_last_layers_bf16
        self.at_start = precision.num_layers_at_start_in_bf16 if outer else 0
        self.at_end = precision.num_layers_at_end_in_bf16 if outer else 0
        self.reports: list[FP8Report] = []

    def __call__(self, stage: nn.Module, setup: ModelSetup) -> None:
        check_device(setup.groups.device, self.recipe)
        self.reports.append(apply_fp8(stage, self.config, num_layers=self.num_layers,
                                      layers_at_start=self.at_start, layers_at_end=self.at_end,
                                      defer_weight_grads=self.defer_weight_grads))


def fp8_pass(run_config) -> SetupPass | None:
    """The run's FP8 pass when it trains in FP8 with a recipe of torchao's, and torchao is
    the backend :func:`~mega.core.fp8_recipes.fp8_backend` picks; None otherwise."""
    precision = run_config.precision
    if precision.fp8 is None or precision.fp8_recipe not in RECIPES:
        return None
    if fp8_backend(precision, run_config.kernels.kernels, get_plugins()).name != "torchao":
        return None
    available, missing = get_plugins().kernel_backends.get("torchao").is_available()
    if not available:
        raise ConfigError(f"--fp8-recipe {precision.fp8_recipe}: {missing}")
    # A zero-bubble schedule (any but 1f1b) leaves weight gradients to its W steps.
    chunk_pass = FP8Pass(precision, run_config.model.num_layers, run_config.pipeline.pipeline_schedule != "1f1b")
    return per_chunk("fp8-torchao", Phase.PRECISION, chunk_pass)
