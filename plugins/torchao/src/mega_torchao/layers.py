"""mega's column- and row-parallel linear layers computing their products in FP8 with torchao.

Each of a linear layer's three products (output, input gradient, weight gradient) casts its
operands to FP8 with torchao (``hp_tensor_and_scale_to_float8``: a ``Float8TrainingTensor``
whose ``mm`` is ``torch._scaled_mm``) under the scales of the run's ``Float8LinearConfig``, as
torchao's ``Float8Linear`` does. Under tensor parallelism an operand split along the dimension
its scale is taken over (a column-parallel weight for tensorwise scaling, a row-parallel input
for rowwise...) has its amax reduced (MAX) over the tensor group first, so every layout scales,
and so rounds, the same numbers the same way one process does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchao.float8.config import Float8LinearConfig, ScalingGranularity, ScalingType
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig, hp_tensor_and_scale_to_float8
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

from mega.core.parallel.groups import Group
from mega.core.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mega.core.parallel.weight_grad_split import defer, deferral_target


@dataclass(frozen=True)
class Float8Products:
    """How one layer casts: torchao's config, its GEMM settings, and which dimension of each 2-D
    operand (``input`` [tokens, in], ``weight_t`` [in, out], ``grad_output`` [tokens, out]) is
    split over ``group`` (None: held whole)."""

    config: Float8LinearConfig
    mm_config: LinearMMConfig
    group: Group | None = None
    input_split: int | None = None
    weight_t_split: int | None = None
    grad_output_split: int | None = None

    def cast(self, hp: torch.Tensor, cast_config, role: GemmInputRole, axis: int, split: int | None):
        """``hp`` in FP8 (or as it is where the config keeps it in high precision), scaled over
        ``axis`` (rowwise) or whole (tensorwise), the amax taken over the tensor group where split."""
        if cast_config.scaling_type is ScalingType.DISABLED:
            return hp
        granularity = cast_config.scaling_granularity
        axiswise_dim = get_maybe_axiswise_dim(axis, granularity)
        amax = tensor_to_amax(hp, False, None, granularity, axiswise_dim)
        scaled_over_split = granularity is ScalingGranularity.TENSORWISE or axiswise_dim % hp.dim() == split
        if split is not None and scaled_over_split and self.group is not None and self.group.size > 1:
            amax = amax.clone()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group.group)
        scale = amax_to_scale(amax, cast_config.target_dtype, self.config.round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(hp, scale, cast_config.target_dtype, self.mm_config, role, axiswise_dim)


class _Float8Matmul(torch.autograd.Function):
    """``x @ weight.T`` with the three products in FP8 (torchao's ``matmul_with_hp_or_float8_args``
    with the amaxes of split operands reduced). ``deferred``: ``(pending, weight parameter)``
    under a zero-bubble schedule, whose W step gets the weight-gradient product (its casts too)."""

    @staticmethod
    def forward(ctx, x, weight, products: Float8Products, deferred=None):
        ctx.save_for_backward(x, weight)
        ctx.products, ctx.deferred = products, deferred
        c = products.config
        x_2d = x.reshape(-1, x.shape[-1])
        x_fp8 = products.cast(x_2d, c.cast_config_input, GemmInputRole.INPUT, -1, products.input_split)
        w_fp8 = products.cast(weight.t(), c.cast_config_weight, GemmInputRole.WEIGHT, 0, products.weight_t_split)
        return torch.mm(x_fp8, w_fp8).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        products = ctx.products
        c = products.config
        go_2d = grad_output.reshape(-1, grad_output.shape[-1])
        go_fp8 = products.cast(go_2d, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1,
                               products.grad_output_split)
        w_fp8 = products.cast(weight.t(), c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1,
                              products.weight_t_split)
        grad_input = torch.mm(go_fp8, w_fp8.t()).reshape(*grad_output.shape[:-1], weight.shape[1])
        if ctx.deferred is not None:
            pending, parameter = ctx.deferred
            defer(pending, lambda: [(parameter, _float8_weight_grad(x, go_2d, products))], (parameter,))
            return grad_input, None, None, None
        return grad_input, _float8_weight_grad(x, go_2d, products), None, None


def _float8_weight_grad(x: torch.Tensor, go_2d: torch.Tensor, products: Float8Products) -> torch.Tensor:
    """The weight-gradient product ``grad_output^T @ x``, its operands cast for it."""
    c = products.config
    go_fp8 = products.cast(go_2d, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0,
                           products.grad_output_split)
    x_fp8 = products.cast(x.reshape(-1, x.shape[-1]), c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0,
                          products.input_split)
    return torch.mm(go_fp8.t(), x_fp8)


@torch.compiler.disable
def float8_matmul(x: torch.Tensor, weight: torch.Tensor, products: Float8Products) -> torch.Tensor:
    """Eager under ``--compile``: the amax all-reduces are process-group calls dynamo does not
    trace. Only tensor-parallel layers take this path; one process's linear layers are
    torchao's ``Float8Linear``, which compiles. Inside ``deferring_weight_grads`` the weight
    gradient (with its casts and their amax reduces, which every rank of the tensor group runs
    in the same W) waits for the W step."""
    pending = deferral_target(weight)
    if pending is not None and weight.requires_grad:
        # The weight enters detached: its gradient reaches autograd (and its hooks) at W.
        return _Float8Matmul.apply(x, weight.detach(), products, (pending, weight))
    return _Float8Matmul.apply(x, weight, products)


def mm_config(config: Float8LinearConfig) -> LinearMMConfig:
    """The GEMM settings torchao's ``Float8Linear`` derives from ``config`` (fast accumulation
    in the forward product only, by default)."""
    with torch.device("meta"):
        return Float8Linear(1, 1, bias=False, config=config).linear_mm_config


class _Float8LocalProduct:
    """Mixed into mega's parallel layers: the local product in FP8, the collectives the layer's."""

    def __init__(self, *args, fp8: Float8Products, **kwargs):
        super().__init__(*args, **kwargs)
        self.fp8 = fp8

    def local_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = float8_matmul(x, self.weight, self.fp8)
        return y if bias is None else y + bias.to(y.dtype)


class Float8DeferringLinear(torch.nn.Linear):
    """A linear layer of one process with torchao's ``Float8Linear``'s products (bit for bit), for
    the zero-bubble schedules: it runs them through :func:`float8_matmul`, whose weight gradient
    waits for the W step (``Float8Linear``'s autograd function is torchao's and computes it in
    B). Eager under ``--compile``, as the tensor-parallel FP8 layers."""

    fp8: Float8Products

    @classmethod
    def from_linear(cls, layer: torch.nn.Linear, config: Float8LinearConfig) -> Float8DeferringLinear:
        new = cls(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta",
                  dtype=layer.weight.dtype)
        new.fp8 = Float8Products(config, mm_config(config))
        return _holding_parameters_of(layer, new)

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """``add_bias=False`` leaves the bias to the caller, as mega's ``Linear``."""
        y = float8_matmul(x, self.weight, self.fp8)
        return y + self.bias.to(y.dtype) if add_bias and self.bias is not None else y


class Float8ColumnParallelLinear(_Float8LocalProduct, ColumnParallelLinear):
    """:class:`ColumnParallelLinear` with its product in FP8. Its weight is split along the output
    features: the weight's and the output gradient's amaxes are reduced over the tensor group."""

    @classmethod
    def from_parallel(cls, layer: ColumnParallelLinear, config: Float8LinearConfig) -> Float8ColumnParallelLinear:
        fp8 = Float8Products(config, mm_config(config), layer.group, weight_t_split=1, grad_output_split=1)
        new = cls(layer.in_features, layer.out_features, layer.group, bias=layer.bias is not None,
                  gather_output=layer.gather_output, sequence_parallel=layer.sequence_parallel, chunks=layer.chunks,
                  device="meta", dtype=layer.weight.dtype, fp8=fp8)
        return _holding_parameters_of(layer, new)


class Float8RowParallelLinear(_Float8LocalProduct, RowParallelLinear):
    """:class:`RowParallelLinear` with its product in FP8. Its weight and input are split along
    the input features: their amaxes are reduced over the tensor group."""

    @classmethod
    def from_parallel(cls, layer: RowParallelLinear, config: Float8LinearConfig) -> Float8RowParallelLinear:
        fp8 = Float8Products(config, mm_config(config), layer.group, input_split=1, weight_t_split=0)
        new = cls(layer.in_features, layer.out_features, layer.group, bias=layer.bias is not None,
                  sequence_parallel=layer.sequence_parallel, device="meta", dtype=layer.weight.dtype, fp8=fp8)
        return _holding_parameters_of(layer, new)


def _holding_parameters_of(old: torch.nn.Module, new: torch.nn.Module) -> torch.nn.Module:
    """``new`` with ``old``'s parameter objects (their marks, main_grad views and checkpoint
    names stay) and its forward hooks (sequence-parallel scatters...)."""
    new.weight = old.weight
    new.bias = old.bias
    new._forward_hooks.update(old._forward_hooks)
    new._forward_pre_hooks.update(old._forward_pre_hooks)
    return new
