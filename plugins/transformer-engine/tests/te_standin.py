"""A stand-in for NVIDIA Transformer Engine's PyTorch API, in plain torch, for tests without TE or
a GPU. It implements the documented call signatures mega uses (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``,
``LayerNorm``, ``RMSNorm``, ``DotProductAttention``, ``fp8_autocast``, ``recipe.DelayedScaling``)
with TE's semantics where they matter to the plumbing: local shard shapes from ``tp_size`` and
``parallel_mode``, tensor/sequence-parallel communication over ``tp_group`` (all-gather of the
input along the sequence, reduce-scatter or all-reduce of the output), ``sbhd`` attention with
GQA groups and TE's mask types (True = masked out), and an FP8 state that ``fp8_autocast`` sets.

It computes in the inputs' dtype, never in FP8: what it proves is that mega drives TE correctly,
not that TE's kernels are right. ``install(monkeypatch)`` puts it in ``sys.modules``; ``STATE``
records every ``fp8_autocast`` entry and exit and every linear forward run under FP8.
"""

from __future__ import annotations

import contextlib
import enum
import math
import sys
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__version__ = "2.0.0+standin"


class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


@dataclass
class DelayedScaling:
    margin: int = 0
    interval: int = 1
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"


@dataclass
class FP8State:
    enabled: bool = False
    recipe: DelayedScaling | None = None
    events: list = field(default_factory=list)  # ("enter", recipe) / ("exit",)


STATE = FP8State()


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: DelayedScaling | None = None,
                 fp8_group=None):
    """Records ("enter", recipe, fp8_group) and ("exit",). Like TE, the outermost autocast
    reduces the amaxes over ``fp8_group`` (None: every rank) as it exits: here a max-all-reduce of
    the forwards it saw, so ranks of a group that do not exit together wait for each other."""
    saved = (STATE.enabled, STATE.recipe)
    outermost = not STATE.enabled
    STATE.enabled, STATE.recipe = enabled, fp8_recipe or DelayedScaling()
    STATE.events.append(("enter", STATE.recipe, fp8_group))
    try:
        yield
    finally:
        STATE.enabled, STATE.recipe = saved
        if outermost and enabled and dist.is_initialized():
            dist.all_reduce(torch.ones(1), op=dist.ReduceOp.MAX, group=fp8_group)
        STATE.events.append(("exit",))


# -- tensor/sequence-parallel communication along dimension 0 (the sequence in sbhd) -------------
def _size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _all_reduce(x, group):
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x, group):
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter(x, group):
    return _all_reduce(x, group).chunk(_size(group), dim=0)[dist.get_rank(group)].contiguous()


class _Copy(torch.autograd.Function):  # column input, no SP: identity, gradient summed
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):  # row output, no SP
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):  # column input under SP
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):  # row output under SP
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group), None


class _FP8Counted(nn.Module):
    """TE keeps FP8 scaling state in ``get_extra_state()``; the stand-in counts the forwards
    run under ``fp8_autocast`` there instead."""

    def __init__(self):
        super().__init__()
        self.fp8_forwards = 0

    def _count_fp8_forward(self):
        self.fp8_forwards += int(STATE.enabled)

    def get_extra_state(self):
        return torch.tensor([self.fp8_forwards], dtype=torch.int64)

    def set_extra_state(self, state):
        if state is not None and state.numel():
            self.fp8_forwards = int(state[0])


class _ParallelLinearBase(_FP8Counted):
    def __init__(self, in_features, out_features, bias=True, *, init_method=None, sequence_parallel=False,
                 tp_group=None, tp_size=1, parallel_mode=None, device="cuda", params_dtype=None, **unused):
        super().__init__()
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"parallel_mode {parallel_mode!r}")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.tp_size, self.parallel_mode = tp_group, tp_size, parallel_mode
        self.sequence_parallel = sequence_parallel
        local_in = in_features // tp_size if parallel_mode == "row" else in_features
        local_out = out_features // tp_size if parallel_mode == "column" else out_features
        options = {"device": device, "dtype": params_dtype or torch.float32}
        self.weight = nn.Parameter(torch.empty(local_out, local_in, **options))
        self.bias = nn.Parameter(torch.empty(local_out, **options)) if bias else None
        if self.weight.device.type != "meta":
            (init_method or (lambda w: nn.init.normal_(w, 0.0, 0.023)))(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def _linear(self, x):
        self._count_fp8_forward()
        if self.parallel_mode == "column":
            x = (_Gather if self.sequence_parallel else _Copy).apply(x, self.tp_group)
            return F.linear(x, self.weight, self.bias)
        if self.parallel_mode == "row":
            y = F.linear(x, self.weight)
            y = (_ReduceScatter if self.sequence_parallel else _Reduce).apply(y, self.tp_group)
            return y + self.bias if self.bias is not None else y
        return F.linear(x, self.weight, self.bias)


class Linear(_ParallelLinearBase):
    def forward(self, inp, is_first_microbatch=None):
        return self._linear(inp)


def _normalize(x, normalization, weight, bias, eps):
    if normalization == "RMSNorm":
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


class LayerNormLinear(_ParallelLinearBase):
    def __init__(self, in_features, out_features, eps=1e-5, bias=True, normalization="LayerNorm", **kwargs):
        super().__init__(in_features, out_features, bias, **kwargs)
        self.eps, self.normalization = eps, normalization
        options = {"device": self.weight.device, "dtype": self.weight.dtype}
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, **options))
        self.layer_norm_bias = (nn.Parameter(torch.zeros(in_features, **options))
                                if normalization == "LayerNorm" else None)

    def forward(self, inp, is_first_microbatch=None):
        # TE normalises the local sequence shard, then gathers the normalised input.
        return self._linear(_normalize(inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias,
                                       self.eps))


def _gated(activation):
    return lambda x: (lambda gate, up: activation(gate) * up)(*x.chunk(2, dim=-1))


# TE's activations ("gelu" is the tanh approximation in TE's kernels); the gated ones take
# [gate; up] stacked on the last dimension, as TE's swiglu does.
MLP_ACTIVATIONS = {"gelu": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu,
                   "geglu": _gated(lambda x: F.gelu(x, approximate="tanh")), "reglu": _gated(F.relu),
                   "swiglu": _gated(F.silu)}
GATED = {"geglu", "reglu", "swiglu"}


class LayerNormMLP(_FP8Counted):
    """norm -> fc1 -> activation -> fc2, TE's parameters (``layer_norm_weight``/``_bias``,
    ``fc1_weight``/``_bias``, ``fc2_weight``/``_bias``) and parallelism: with
    ``set_parallel_mode`` fc1 is column- and fc2 row-parallel over ``tp_group`` (the normalised
    input all-gathered along the sequence and the output reduce-scattered under sequence
    parallelism), fc2's bias added after the reduction. ``return_bias`` leaves fc2's bias out
    of the output and returns it; ``return_layernorm_output`` returns the norm's output too
    (this rank's sequence shard, or gathered with ``return_layernorm_output_gathered``)."""

    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, sequence_parallel=False, return_bias=False,
                 get_rng_state_tracker=None, tp_group=None, tp_size=1, init_method=None, bias=True,
                 normalization="LayerNorm", activation="gelu", output_layer_init_method=None, params_dtype=None,
                 return_layernorm_output=False, return_layernorm_output_gathered=False, set_parallel_mode=False,
                 zero_centered_gamma=False, device="cuda", **unused):
        super().__init__()
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization {normalization!r}")
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"activation {activation!r}")
        self.tp_group = tp_group
        self.tp_size = tp_size if tp_group is None else _size(tp_group)
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        self.set_parallel_mode, self.eps, self.normalization = set_parallel_mode, eps, normalization
        self.activation, self.use_bias, self.return_bias = activation, bias, return_bias
        self.apply_bias = bias and not return_bias
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered
        self.zero_centered_gamma = zero_centered_gamma
        if ffn_hidden_size % self.tp_size:
            raise ValueError(f"ffn_hidden_size {ffn_hidden_size} is not divisible by tp_size {self.tp_size}")
        local = ffn_hidden_size // self.tp_size
        fc1_out = 2 * local if activation in GATED else local
        options = {"device": device, "dtype": params_dtype or torch.get_default_dtype()}
        self.layer_norm_weight = nn.Parameter(torch.empty(hidden_size, **options))
        self.layer_norm_bias = (nn.Parameter(torch.empty(hidden_size, **options))
                                if normalization == "LayerNorm" else None)
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out, hidden_size, **options))
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, local, **options))
        if bias:
            self.fc1_bias = nn.Parameter(torch.empty(fc1_out, **options))
            self.fc2_bias = nn.Parameter(torch.empty(hidden_size, **options))
        else:  # TE keeps empty tensors, not parameters
            self.fc1_bias = self.fc2_bias = torch.empty(0, **options)
        if self.fc1_weight.device.type != "meta":
            with torch.no_grad():
                self.layer_norm_weight.fill_(0.0 if zero_centered_gamma else 1.0)
                if self.layer_norm_bias is not None:
                    self.layer_norm_bias.zero_()
                (init_method or (lambda w: nn.init.normal_(w, 0.0, 0.023)))(self.fc1_weight)
                (output_layer_init_method or (lambda w: nn.init.normal_(w, 0.0, 0.023)))(self.fc2_weight)
                if bias:
                    self.fc1_bias.zero_()
                    self.fc2_bias.zero_()

    def forward(self, inp, is_first_microbatch=None):
        self._count_fp8_forward()
        gamma = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        ln_out = _normalize(inp, self.normalization, gamma, self.layer_norm_bias, self.eps)
        parallel = self.set_parallel_mode and self.tp_size > 1
        x = ln_out
        if parallel:
            x = (_Gather if self.sequence_parallel else _Copy).apply(x, self.tp_group)
        hidden = MLP_ACTIVATIONS[self.activation](F.linear(x, self.fc1_weight, self.fc1_bias if self.use_bias else None))
        out = F.linear(hidden, self.fc2_weight)
        if parallel:
            out = (_ReduceScatter if self.sequence_parallel else _Reduce).apply(out, self.tp_group)
        if self.apply_bias:
            out = out + self.fc2_bias
        extra = ()
        if self.return_bias:
            extra += (self.fc2_bias,)
        if self.return_layernorm_output:
            extra += (x if self.return_layernorm_output_gathered else ln_out,)
        return (out, *extra) if extra else out


class LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, sequence_parallel=None, params_dtype=None, zero_centered_gamma=False,
                 device="cuda", **unused):
        super().__init__()
        self.eps = eps
        options = {"device": device, "dtype": params_dtype or torch.float32}
        self.weight = nn.Parameter(torch.ones(hidden_size, **options))
        self.bias = nn.Parameter(torch.zeros(hidden_size, **options))

    def forward(self, inp):
        return _normalize(inp, "LayerNorm", self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, sequence_parallel=None, params_dtype=None, zero_centered_gamma=False,
                 device="cuda", **unused):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=params_dtype or torch.float32))

    def forward(self, inp):
        return _normalize(inp, "RMSNorm", self.weight, None, self.eps)


MASK_TYPES = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal")


class DotProductAttention(nn.Module):
    """softmax(q k^T * scale [+ bias] [masked]) v over ``sbhd`` (or ``bshd``) inputs; the output
    is ``[s, b, heads * head_dim]``. TE's ``causal`` aligns at the top left."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", softmax_scale=None, **unused):
        super().__init__()
        if attn_mask_type not in MASK_TYPES:
            raise ValueError(f"attn_mask_type {attn_mask_type!r}")
        self.heads, self.head_dim = num_attention_heads, kv_channels
        self.groups = num_gqa_groups or num_attention_heads
        self.dropout, self.qkv_format, self.mask_type = attention_dropout, qkv_format, attn_mask_type
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels)

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                attn_mask_type=None, core_attention_bias_type="no_bias", core_attention_bias=None, **unused):
        layout = qkv_format or self.qkv_format
        mask_type = attn_mask_type or self.mask_type
        to_bhsd = (lambda t: t.permute(1, 2, 0, 3)) if layout == "sbhd" else (lambda t: t.permute(0, 2, 1, 3))
        q, k, v = (to_bhsd(t) for t in (query_layer, key_layer, value_layer))
        if k.shape[1] != self.groups or q.shape[1] != self.heads:
            raise ValueError("heads do not match num_attention_heads / num_gqa_groups")
        k, v = (t.repeat_interleave(self.heads // self.groups, dim=1) for t in (k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if core_attention_bias_type == "post_scale_bias":
            scores = scores + core_attention_bias
        q_len, k_len = scores.shape[-2:]
        masked = torch.zeros(q_len, k_len, dtype=torch.bool, device=scores.device)
        if mask_type in ("causal", "padding_causal"):
            masked = ~torch.ones_like(masked).tril(0)
        elif mask_type == "causal_bottom_right":
            masked = ~torch.ones_like(masked).tril(k_len - q_len)
        if mask_type.startswith("padding"):
            masked = masked | attention_mask
        scores = scores.masked_fill(masked, float("-inf"))
        probs = F.dropout(torch.softmax(scores, dim=-1), self.dropout, self.training)
        out = torch.matmul(probs, v)  # [b, h, s, d]
        if layout == "sbhd":
            return out.permute(2, 0, 1, 3).flatten(2)
        return out.permute(0, 2, 1, 3).flatten(2)


def install(monkeypatch=None) -> FP8State:
    """Make ``import transformer_engine`` (``.pytorch``, ``.common.recipe``) give this stand-in;
    with ``monkeypatch`` the modules go away after the test. Returns a fresh FP8 record."""
    this = sys.modules[__name__]
    package = types.ModuleType("transformer_engine")
    package.__version__ = __version__
    package.__path__ = []
    pytorch = types.ModuleType("transformer_engine.pytorch")
    for name in ("Linear", "LayerNormLinear", "LayerNormMLP", "LayerNorm", "RMSNorm", "DotProductAttention",
                 "fp8_autocast"):
        setattr(pytorch, name, getattr(this, name))
    common = types.ModuleType("transformer_engine.common")
    common.__path__ = []
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format, recipe.DelayedScaling = Format, DelayedScaling
    package.pytorch, package.common, common.recipe = pytorch, common, recipe
    modules = {"transformer_engine": package, "transformer_engine.pytorch": pytorch,
               "transformer_engine.common": common, "transformer_engine.common.recipe": recipe}
    for name, module in modules.items():
        if monkeypatch is not None:
            monkeypatch.setitem(sys.modules, name, module)
        else:
            sys.modules[name] = module
    STATE.enabled, STATE.recipe = False, None
    STATE.events.clear()
    return STATE
