"""mega's kernel contracts filled with Transformer Engine's modules.

The models are built on the meta device and made tensor-parallel from outside; TE's linear
layers instead take their tensor group at construction (``tp_group``, ``tp_size``,
``parallel_mode``, ``sequence_parallel``) and communicate themselves. So the single-device
layers built here implement ``to_tensor_parallel``: the plan's style becomes TE's
``parallel_mode`` and a new TE module holding this rank's shard replaces the old one. Its
parameters are marked the way mega's own parallel layers are (``partition_dim``,
``partition_chunks``), so initialisation, gradient reduction and checkpoints treat them alike.

Parameter names are TE's, which are also Megatron-Core's TE names: ``weight``/``bias``, and in
LayerNormLinear ``layer_norm_weight``/``layer_norm_bias`` (mega-models maps these to the
canonical ``input_layernorm.*``/``pre_mlp_layernorm.*``). LayerNormMLP (the whole MLP block)
holds ``layer_norm_*``, ``fc1_*`` and ``fc2_*``, which mega-models maps to
``pre_mlp_layernorm.*``, ``mlp.linear_fc1.*`` and ``mlp.linear_fc2.*``. FP8 scaling state is TE's
``get_extra_state()``, which mega's checkpoints keep per tensor-parallel rank.
"""

from __future__ import annotations

import torch

from mega.core.config import ConfigError
from mega.core.kernels import AttentionMask
from mega.core.parallel.layers import shard_of
from mega.core.parallel.param_attrs import mark_tensor_parallel
from mega.core.parallel.plan import ColumnThenRow, Colwise, Rowwise


def _placement() -> dict:
    """Where new parameters go: the default device and dtype in force (``build_stage`` builds
    under ``torch.device("meta")``; TE's own default would be the current CUDA device)."""
    probe = torch.empty(0)
    return {"device": probe.device, "params_dtype": probe.dtype}


class _TensorParallel:
    """Mixed into TE's Linear and LayerNormLinear: ``to_tensor_parallel`` (mega's hook for
    layers that do their own TP/SP communication) rebuilds the layer with TE's parallel mode."""

    def __init__(self, arguments: dict, **parallel):
        super().__init__(**arguments, **parallel)
        self.mega_arguments = arguments

    def to_tensor_parallel(self, style, group, sequence_parallel: bool):
        if isinstance(style, Colwise):
            if style.gather_output:
                raise ValueError(f"{type(self).__name__}: Transformer Engine's column-parallel layer "
                                 "does not gather its output")
            mode, dim, chunks = "column", 0, style.chunks
        elif isinstance(style, Rowwise):
            mode, dim, chunks = "row", 1, 1
        else:
            raise TypeError(f"{type(self).__name__} cannot be split as {type(style).__name__}")
        layer = type(self)(self.mega_arguments, tp_group=group.group, tp_size=group.size, parallel_mode=mode,
                           sequence_parallel=sequence_parallel, device=self.weight.device,
                           params_dtype=self.weight.dtype)
        mark_tensor_parallel(layer.weight, dim, chunks)
        if mode == "column" and _has(layer, "bias"):
            mark_tensor_parallel(layer.bias, 0, chunks)
        return _with_shards_of(self, layer, group)


class _TensorParallelMLP:
    """Mixed into TE's LayerNormMLP: the ``ColumnThenRow`` style becomes TE's
    ``set_parallel_mode=True`` (fc1 column-parallel, fc2 row-parallel, fc2's bias added after the
    reduction), with the tensor group and sequence parallelism."""

    def __init__(self, arguments: dict, **parallel):
        super().__init__(**arguments, **parallel)
        self.mega_arguments = arguments

    def to_tensor_parallel(self, style, group, sequence_parallel: bool):
        if not isinstance(style, ColumnThenRow):
            raise TypeError(f"{type(self).__name__} (fc1 and fc2 in one module) is split as ColumnThenRow, "
                            f"not {type(style).__name__}")
        layer = type(self)(self.mega_arguments, tp_group=group.group, tp_size=group.size, set_parallel_mode=True,
                           sequence_parallel=sequence_parallel, device=self.fc1_weight.device,
                           params_dtype=self.fc1_weight.dtype)
        mark_tensor_parallel(layer.fc1_weight, 0, style.chunks)
        if _has(layer, "fc1_bias"):
            mark_tensor_parallel(layer.fc1_bias, 0, style.chunks)
        mark_tensor_parallel(layer.fc2_weight, 1)
        return _with_shards_of(self, layer, group)


def _with_shards_of(whole: torch.nn.Module, layer: torch.nn.Module, group) -> torch.nn.Module:
    """``layer`` holding this rank's shard of ``whole``'s weights, unless ``whole`` was built on
    the meta device (``build_stage``: the shards are initialised later, by name)."""
    if next(whole.parameters()).is_meta:
        return layer
    with torch.no_grad():
        for name, param in layer.named_parameters():
            full = getattr(whole, name)
            split = getattr(param, "tensor_model_parallel", False)
            part = getattr(param, "partition_dim", 0)
            param.copy_(shard_of(full, group, part, getattr(param, "partition_chunks", 1)) if split else full)
    return layer


def _has(module, name: str) -> bool:
    param = getattr(module, name, None)
    return isinstance(param, torch.nn.Parameter) and param.numel() > 0


def linear_factory(te):
    cls = type("TELinear", (_TensorParallel, te.Linear), {})

    def linear(in_features: int, out_features: int, bias: bool = True):
        return cls({"in_features": in_features, "out_features": out_features, "bias": bias}, **_placement())

    return linear


def norm_linear_factory(te):
    cls = type("TELayerNormLinear", (_TensorParallel, te.LayerNormLinear), {})

    def norm_linear(norm_kind: str, in_features: int, out_features: int, bias: bool, eps: float):
        return cls({"in_features": in_features, "out_features": out_features, "bias": bias, "eps": eps,
                    "normalization": _norm_kind(norm_kind)}, **_placement())

    return norm_linear


# mega's activation names -> LayerNormMLP's, where TE computes the same function. TE's "gelu" is
# the tanh approximation (mega's "gelu_tanh", --openai-gelu); exact GELU has no LayerNormMLP form.
MLP_ACTIVATIONS = {"gelu_tanh": "gelu", "swiglu": "swiglu", "relu": "relu"}


def norm_mlp_factory(te):
    cls = type("TELayerNormMLP", (_TensorParallelMLP, te.LayerNormMLP), {})

    def norm_mlp(norm_kind: str, hidden_size: int, ffn_hidden_size: int, activation: str, bias: bool, eps: float):
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"Transformer Engine's LayerNormMLP has no activation equal to {activation!r}; "
                             f"it fuses {', '.join(MLP_ACTIVATIONS)}")
        return cls({"hidden_size": hidden_size, "ffn_hidden_size": ffn_hidden_size, "eps": eps, "bias": bias,
                    "normalization": _norm_kind(norm_kind), "activation": MLP_ACTIVATIONS[activation]},
                   **_placement())

    norm_mlp.activations = frozenset(MLP_ACTIVATIONS)
    return norm_mlp


def norm_factory(te):
    def norm(kind: str, hidden_size: int, eps: float):
        module = {"LayerNorm": te.LayerNorm, "RMSNorm": te.RMSNorm}[_norm_kind(kind)]
        return module(hidden_size, eps=eps, **_placement())

    return norm


def _norm_kind(kind: str) -> str:
    if kind not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"no normalization {kind!r}; choose LayerNorm or RMSNorm")
    return kind


class TEAttention:
    """The ``attention`` contract on TE's DotProductAttention.

    mega passes ``[batch, heads, seq, head_dim]`` views of ``[seq, batch, heads, head_dim]``
    activations, so the permutation back to TE's ``sbhd`` layout costs no copy. TE's module holds
    no weights; one is kept per shape and setting. GQA goes to TE as ``num_gqa_groups`` (no
    repeated heads). TE's ``causal`` mask is aligned at the top left, mega's at the end: the two
    agree when queries and keys are equally many, ``causal_bottom_right`` serves the rest.
    Packed sequences (``cu_seqlens``) are not wired to TE's ``thd`` format and are refused.
    """

    def __init__(self, te):
        self.te = te
        self._modules: dict[tuple, torch.nn.Module] = {}

    def _module(self, heads: int, kv_heads: int, head_dim: int, dropout_p: float, softmax_scale, mask_type: str):
        key = (heads, kv_heads, head_dim, dropout_p, softmax_scale, mask_type)
        if key not in self._modules:
            self._modules[key] = self.te.DotProductAttention(
                heads, head_dim, num_gqa_groups=kv_heads, attention_dropout=dropout_p, qkv_format="sbhd",
                attn_mask_type=mask_type, softmax_scale=softmax_scale)
        return self._modules[key]

    def __call__(self, query, key, value, *, mask: AttentionMask, dropout_p: float = 0.0,
                 softmax_scale: float | None = None):
        if mask.cu_seqlens is not None:
            raise ConfigError("--attention-backend transformer-engine does not take packed sequences (cu_seqlens: "
                              "TE's thd format is not wired); use --attention-backend torch or flash-attn")
        batch, heads, q_len, head_dim = query.shape
        k_len = key.shape[2]
        mask_type, extra = _mask_arguments(mask, q_len, k_len)
        module = self._module(heads, key.shape[1], head_dim, dropout_p, softmax_scale, mask_type)
        q, k, v = (t.permute(2, 0, 1, 3) for t in (query, key, value))  # [s, b, h, d]
        out = module(q, k, v, **extra)  # [s, b, h * d]
        return out.view(q_len, batch, heads, head_dim).permute(1, 2, 0, 3)


def _mask_arguments(mask: AttentionMask, q_len: int, k_len: int) -> tuple[str, dict]:
    causal = "causal" if q_len == k_len else "causal_bottom_right"
    extra: dict = {}
    if mask.padding is not None:
        if q_len != k_len:
            raise ConfigError("--attention-backend transformer-engine takes a padding mask only when queries and "
                              "keys are equally many (TE's padding masks are not aligned at the end); use "
                              "--attention-backend torch")
        extra["attention_mask"] = ~mask.padding.to(torch.bool)[:, None, None, :]  # TE: True = masked out
        mask_type = "padding_causal" if mask.causal else "padding"
    else:
        mask_type = causal if mask.causal else "no_mask"
    if mask.bias is not None:
        extra.update(core_attention_bias_type="post_scale_bias", core_attention_bias=mask.bias)
    return mask_type, extra
