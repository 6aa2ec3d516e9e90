"""Causal self-attention with multi-head or grouped-query attention, written for one device.

``linear_qkv`` produces Megatron's per-group layout: for each key/value group, its query heads,
then its key head, then its value head. Tensor parallelism splits that weight's rows into whole
groups, so the local number of groups is read from the activation's width, never from the
config: the same code runs on a full or a sharded layer.

The attention kernel, the rotary embedding and the linear layers come from the selected kernels.
The layout reaches it at construction, in a :class:`~mega.core.model_family.ParallelContext`
(None: one device): the attention core's ``dropout_rng_tracker`` (the heads are a rank's own
shard, so dropout forks into the tracker's model-parallel stream; not under sequence parallelism,
where the whole stack runs in it). ``recompute_core`` (selective recompute) and
``recompute_rng_tracker`` (replayed while recomputing) are set by the recompute setup pass of
:mod:`mega.models.parallelize` instead: recompute is a phase of the setup of its own (after the
adapters and FP8 layers it recomputes, before compile), which a run may leave out.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mega.core.kernels import CAUSAL, AttentionMask, Kernels
from mega.core.model_family import ParallelContext
from mega.models.blocks.kv_cache import LayerKVCache
from mega.models.blocks.norms import input_linear
from mega.models.blocks.recompute import is_recomputing_allowed, recomputed
from mega.models.blocks.rope import RotaryAngles, layer_cos_sin, rotary_cos_sin
from mega.models.blocks.sliding_window import query_positions, with_sliding_window
from mega.models.config import TransformerConfig


def head_norm(config: TransformerConfig, kernels: Kernels, heads: int = 1) -> nn.Module:
    """A QK-norm of the model's kind and epsilon: over one head's ``kv_channels``, or over the
    whole projection of ``heads`` heads (``--qk-layernorm-scope projection``)."""
    size = config.kv_channels * (heads if config.qk_layernorm_scope == "projection" else 1)
    return kernels.norm(config.normalization, size, config.layernorm_epsilon)


class CoreAttention(nn.Module):
    """softmax(q k^T * scale + mask) v with dropout; no parameters.

    Takes and returns ``[seq, batch, heads, head_dim]`` / ``[seq, batch, heads * head_dim]``; the
    kernel sees ``[batch, heads, seq, head_dim]`` views of the inputs (see :func:`sequence_major`
    for the output). This is the region selective recompute
    recomputes: cheap to redo, quadratic in the sequence to store.
    """

    def __init__(self, config: TransformerConfig, kernels: Kernels, context: ParallelContext | None = None):
        super().__init__()
        self.kernels = kernels
        kernels.get("attention")  # resolve the backend now: a compiled forward must not trace the plugin lookup
        self.dropout_p = config.attention_dropout
        self.softmax_scale = config.attention_softmax_scale
        # The heads are this rank's own: their dropout forks into the tracker's model-parallel stream.
        self.dropout_rng_tracker = context.attention_dropout_tracker if context is not None else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: AttentionMask = CAUSAL) -> torch.Tensor:
        # Views, no copies: the fused kernels read any layout whose head dimension is contiguous.
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        tracker = self.dropout_rng_tracker
        fork = tracker.fork() if tracker is not None and dropout_p > 0 else contextlib.nullcontext()
        with fork:
            out = self.attend(query, key, value, mask, dropout_p)
        return sequence_major(out)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: AttentionMask,
               dropout_p: float) -> torch.Tensor:
        """The kernel's attention of ``[batch, heads, seq, head_dim]`` views (a subclass may
        change the softmax: gpt-oss's sinks)."""
        return self.kernels.attention(query, key, value, mask=mask, dropout_p=dropout_p,
                                      softmax_scale=self.softmax_scale)


def sequence_major(out: torch.Tensor) -> torch.Tensor:
    """The kernel's ``[batch, heads, seq, head_dim]`` output as ``[seq, batch, heads * head_dim]``,
    contiguous, for the output projection.

    A view where the kernel laid its output out like the query it was given (sequence-major:
    torch's CPU flash kernel, cuDNN); one copy where it wrote ``[batch, seq, heads, head_dim]``
    (flash and memory-efficient on CUDA). That copy is the one the layers' ``[s, b, h]`` layout
    cannot avoid. Made here, once: left to the projection's reshape, the fused weight-gradient
    path (``--gradient-accumulation-fusion``) would make it again in the backward."""
    seq, batch = out.shape[2], out.shape[0]
    return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


class SelfAttention(nn.Module):
    # How RoPE's angles are made where the model hands none (a subclass may scale them: YaRN).
    cos_sin = staticmethod(rotary_cos_sin)

    def __init__(self, config: TransformerConfig, kernels: Kernels, context: ParallelContext | None = None):
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.head_dim = config.kv_channels
        self.queries_per_group = config.num_attention_heads // config.num_query_groups
        qkv_size = config.query_projection_size + 2 * config.kv_projection_size
        self.linear_qkv = input_linear(config, kernels, qkv_size, bias=config.add_bias_linear or config.add_qkv_bias)
        # QK-norm: one norm over the head dimension, shared by every query (key) head.
        self.q_layernorm = head_norm(config, kernels, config.num_attention_heads) if config.qk_layernorm else None
        self.k_layernorm = head_norm(config, kernels, config.num_query_groups) if config.qk_layernorm else None
        self.qk_norm_rows = config.qk_layernorm_scope == "projection"  # a row is a token's projection, not a head
        self.core_attention = CoreAttention(config, kernels, context)
        self.linear_proj = kernels.linear(config.query_projection_size, config.hidden_size,
                                          bias=config.add_bias_linear)
        if config.position_embedding_type == "rope":
            kernels.get("rotary")  # resolved now, as the attention kernel is
        self.sliding_window = config.sliding_window  # (a family may vary it by layer: gpt-oss's)
        self.recompute_core = False
        self.recompute_rng_tracker = None

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                inference_cache: LayerKVCache | None = None, mask: AttentionMask = CAUSAL,
                rotary_angles: RotaryAngles | None = None) -> torch.Tensor:
        """``inference_cache``: this layer's keys and values so far, when generating (see
        :mod:`mega.models.blocks.kv_cache`); the new ones are appended and attended to. ``mask``: which
        keys each query sees (an encoder's padding mask; causal by default). ``rotary_angles``:
        RoPE's cos and sin, made once per forward by the model (:mod:`mega.models.blocks.rope`); None:
        made here."""
        qkv = self.linear_qkv(hidden)
        seq, batch, _ = qkv.shape
        d, per_group = self.head_dim, self.queries_per_group
        qkv = qkv.view(seq, batch, -1, (per_group + 2) * d)  # [s, b, local groups, ...]
        query, key, value = qkv.split([per_group * d, d, d], dim=-1)  # views of qkv
        query = query.unflatten(-1, (per_group, d))  # [s, b, groups, queries per group, d], a view
        if self.q_layernorm is not None and self.qk_norm_rows:
            # The whole projection (one tensor-parallel rank holds it all; the config says so):
            # heads are group-major in both layouts, so Hugging Face's weight applies as it is.
            query = self.q_layernorm(query.reshape(seq, batch, -1)).view(query.shape)
            key = self.k_layernorm(key.reshape(seq, batch, -1)).view(key.shape)
        elif self.q_layernorm is not None:
            # The one copy QK-norm costs: a norm backend may read rows as [tokens, d], which the
            # grouped view cannot give (Megatron reshapes here too). The key's rows can.
            query = self.q_layernorm(query.reshape(seq, batch, -1, d)).unflatten(2, (-1, per_group))
            key = self.k_layernorm(key)
        if self.config.position_embedding_type == "rope":
            cos, sin = layer_cos_sin(self.config, self.cos_sin, rotary_angles, seq, position_ids, qkv.device)
            # The rotated query is a fresh tensor: the grouped heads flatten below without a copy.
            query = self.kernels.rotary(query, cos[:, :, None], sin[:, :, None])
            key = self.kernels.rotary(key, cos, sin)
        query = query.flatten(2, 3)  # [s, b, heads, d]: a view of a fresh tensor (with rope or QK-norm)
        if inference_cache is not None:
            key, value, mask = inference_cache.append(key, value)
            # A cache says causal or not, or (a paged cache, sequences of several lengths) the whole mask.
            mask = mask if isinstance(mask, AttentionMask) else AttentionMask(causal=mask)
        # (a cache may keep only the window's keys and say so in its mask: a ring of them)
        if self.sliding_window is not None and not getattr(inference_cache, "applies_window", False):
            positions = query_positions(position_ids, seq, key.shape[0], inference_cache is not None, qkv.device)
            mask = with_sliding_window(mask, self.sliding_window, positions, key.shape[0], query.dtype)
        if inference_cache is not None:
            context = self.core_attention(query, key, value, mask)
        elif self.recompute_core and is_recomputing_allowed(self):
            context = recomputed(self.core_attention, query, key, value, mask, rng_tracker=self.recompute_rng_tracker)
        else:
            context = self.core_attention(query, key, value, mask)
        return self.linear_proj(context)
