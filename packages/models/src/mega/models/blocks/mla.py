"""Multi-latent attention (DeepSeek-V2/V3), written for one device; megatron-core's
``MLASelfAttention`` names and splits.

Queries pass through a low-rank bottleneck (``--q-lora-rank``; none: one projection), keys and
values through another (``--kv-lora-rank``), each latent normalised; a separate ``rope`` part
of ``--qk-pos-emb-head-dim`` channels carries positions, one key part shared by every head:

    q        = linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))      [heads, nope + rope]
    latent, k_rope = linear_kv_down_proj(x)                              [kv_lora_rank], [rope]
    k_nope, v = linear_kv_up_proj(kv_layernorm(latent))                  [heads, nope], [heads, v]
    k        = [k_nope; rotary(k_rope)] per head,   q = [q_nope; rotary(q_rope)]

(nope = ``--qk-head-dim``, v = ``--v-head-dim``). The rope channels are stored as interleaved
pairs and rotated as halves after de-interleaving, as megatron-core and transformers'
``rope_interleave`` do, so checkpoints map without permutation. With ``--rope-type yarn`` the
frequencies are YaRN's (:func:`yarn_inverse_frequencies`) and the softmax scale grows by
mscale(``--mscale-all-dim``)^2.

Generation caches what MLA needs per token: the normalised latent and the rotated rope key,
``kv_lora_rank + qk_pos_emb_head_dim`` values a layer, handed to the cache as two halves of one
vector so every KV cache (plain, paged, static) holds them as it holds keys and values.

Tensor parallelism (the tensor group at construction, the layers split by the family's plan):
the up projections are column-parallel (whole heads), ``linear_proj`` row-parallel, the down
projections and latent norms whole on every rank. Under sequence parallelism the down
projections run on this rank's slice and the up projections gather the latents; the shared rope
key is gathered (its gradient reduce-scattered); without it the rope key's gradient, partial per
rank's heads, is summed over the tensor group.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mega.core.kernels import CAUSAL, AttentionMask, Kernels
from mega.core.model_family import ParallelContext
from mega.core.parallel.collectives import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
)
from mega.models.blocks.attention import CoreAttention
from mega.models.blocks.kv_cache import LayerKVCache
from mega.models.blocks.recompute import is_recomputing_allowed, recomputed
from mega.models.blocks.rope import RotaryAngles, layer_cos_sin


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inverse_frequencies(config, device: torch.device, dim: int | None = None) -> torch.Tensor:
    """YaRN's frequencies for ``dim`` rope channels (default ``--qk-pos-emb-head-dim``): the
    original ones for short wavelengths, divided by ``--rotary-scaling-factor`` for long ones, a
    linear ramp between the dimensions ``--beta-fast`` and ``--beta-slow`` rotations over
    ``--original-max-position-embeddings`` (rounded outwards to whole dimensions unless the
    config says ``yarn_truncate`` False, as gpt-oss's does)."""
    dim = config.qk_pos_emb_head_dim if dim is None else dim
    base, factor = config.rotary_base, config.rotary_scaling_factor
    extrapolation = 1.0 / base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    if config.rope_type != "yarn":
        return extrapolation

    def correction_dim(rotations: float) -> float:
        return dim * math.log(config.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(config.beta_fast), correction_dim(config.beta_slow)
    if getattr(config, "yarn_truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return extrapolation / factor * ramp + extrapolation * (1 - ramp)


def mla_cos_sin(config, seq_length: int, position_ids: torch.Tensor | None, device: torch.device):
    """cos and sin ``[seq, batch or 1, 1, rope / 2]`` of the rope channels, times YaRN's
    attention factor mscale(--mscale) / mscale(--mscale-all-dim)."""
    factor = 1.0
    if config.rope_type == "yarn":
        factor = (yarn_mscale(config.rotary_scaling_factor, config.mscale)
                  / yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim))
    return scaled_cos_sin(yarn_inverse_frequencies(config, device), factor, seq_length, position_ids, device)


def scaled_cos_sin(inv_freq: torch.Tensor, factor: float, seq_length: int, position_ids: torch.Tensor | None,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[seq, batch or 1, 1, len(inv_freq)]`` of the angles at ``position_ids``
    (default ``0 .. seq_length - 1``), each times YaRN's attention ``factor``."""
    if position_ids is None:
        positions = torch.arange(seq_length, device=device, dtype=torch.float32)[:, None]
    else:
        positions = position_ids.to(device=device, dtype=torch.float32).t()
    angles = (positions[..., None] * inv_freq)[:, :, None, :]
    return angles.cos() * factor, angles.sin() * factor


def mla_softmax_scale(config) -> float:
    scale = 1.0 / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)
    if config.rope_type == "yarn" and config.mscale_all_dim:
        scale *= yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim) ** 2
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Channels stored as pairs (x0, x1), (x2, x3)... as the halves rotary rotates: evens, odds."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MultiLatentAttention(nn.Module):
    def __init__(self, config, kernels: Kernels, context: ParallelContext | None = None):
        super().__init__()
        self.config, self.kernels = config, kernels
        h, heads = config.hidden_size, config.num_attention_heads
        nope, rope, v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        eps = config.layernorm_epsilon
        if config.q_lora_rank is None:
            self.linear_q_proj = kernels.linear(h, heads * (nope + rope), bias=False)
        else:
            self.linear_q_down_proj = kernels.linear(h, config.q_lora_rank, bias=False)
            self.q_layernorm = kernels.norm(config.normalization, config.q_lora_rank, eps)
            self.linear_q_up_proj = kernels.linear(config.q_lora_rank, heads * (nope + rope), bias=False)
        self.linear_kv_down_proj = kernels.linear(h, config.kv_lora_rank + rope, bias=False)
        self.kv_layernorm = kernels.norm(config.normalization, config.kv_lora_rank, eps)
        self.linear_kv_up_proj = kernels.linear(config.kv_lora_rank, heads * (nope + v), bias=False)
        self.core_attention = CoreAttention(config, kernels, context)
        self.core_attention.softmax_scale = mla_softmax_scale(config)
        self.linear_proj = kernels.linear(heads * v, h, bias=False)
        kernels.get("rotary")
        # The tensor group (None: one device) and whether ``hidden`` is a sequence slice, from
        # construction; selective recompute, set by the recompute pass.
        groups = context.groups if context is not None else None
        self.tp_group = groups.tp if groups is not None else None
        self.sequence_parallel = context is not None and context.sequence_parallel
        self.recompute_core = False
        self.recompute_rng_tracker = None

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                inference_cache: LayerKVCache | None = None, mask: AttentionMask = CAUSAL,
                rotary_angles: RotaryAngles | None = None) -> torch.Tensor:
        """``rotary_angles``: :func:`mla_cos_sin` of the whole forward, made once by the model
        (:mod:`mega.models.blocks.rope`); None: made here."""
        config = self.config
        nope, rope, rank = config.qk_head_dim, config.qk_pos_emb_head_dim, config.kv_lora_rank
        if config.q_lora_rank is None:
            query = self.linear_q_proj(hidden)
        else:
            query = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(hidden)))
        seq, batch, _ = query.shape  # the whole sequence (the up projection gathered it)
        query = query.view(seq, batch, -1, nope + rope)
        q_nope, q_rope = query.split([nope, rope], dim=-1)
        latent, k_rope = self.linear_kv_down_proj(hidden).split([rank, rope], dim=-1)
        latent = self.kv_layernorm(latent)
        k_rope = self._whole_rope_key(k_rope)[:, :, None, :]
        cos, sin = layer_cos_sin(config, mla_cos_sin, rotary_angles, seq, position_ids, hidden.device)
        q_rope = self.kernels.rotary(deinterleave(q_rope), cos, sin)
        k_rope = self.kernels.rotary(deinterleave(k_rope), cos, sin)
        if inference_cache is not None:
            latent, k_rope, mask = self._cached(inference_cache, latent, k_rope)
        kv = self.linear_kv_up_proj(latent)
        kv = kv.view(*kv.shape[:2], -1, nope + config.v_head_dim)
        k_nope, value = kv.split([nope, config.v_head_dim], dim=-1)
        key = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        query = torch.cat((q_nope, q_rope), dim=-1)
        v_dim = value.shape[-1]
        padded = v_dim < query.shape[-1] and not isinstance(self.core_attention, CoreAttention)
        if padded:  # context parallelism passes keys and values round together: one head size
            value = torch.nn.functional.pad(value, (0, query.shape[-1] - v_dim))
        if inference_cache is None and self.recompute_core and is_recomputing_allowed(self):
            context = recomputed(self.core_attention, query, key, value, mask, rng_tracker=self.recompute_rng_tracker)
        else:
            context = self.core_attention(query, key, value, mask)
        if padded:
            context = context.view(*context.shape[:2], -1, query.shape[-1])[..., :v_dim].flatten(2)
        return self.linear_proj(context)

    def _whole_rope_key(self, k_rope: torch.Tensor) -> torch.Tensor:
        """The rope key of the whole sequence, whose gradient sums every rank's heads' parts."""
        tp = self.tp_group
        if tp is None or tp.size == 1:
            return k_rope
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(k_rope, tp, tensor_parallel_output_grad=True)
        return copy_to_tensor_parallel_region(k_rope, tp)

    @staticmethod
    def _cached(cache: LayerKVCache, latent: torch.Tensor, k_rope: torch.Tensor):
        """Append this step's latent and rope key ``[s, b, 1, rank + rope]`` (as two halves) to the
        cache; return all of them so far and the mask of the new queries."""
        compressed = torch.cat((latent[:, :, None, :], k_rope), dim=-1)
        half = compressed.shape[-1] // 2
        first, second, causal = cache.append(compressed[..., :half], compressed[..., half:])
        mask = causal if isinstance(causal, AttentionMask) else AttentionMask(causal=causal)
        compressed = torch.cat((first, second), dim=-1)
        rank = latent.shape[-1]
        return compressed[:, :, 0, :rank], compressed[..., rank:], mask
