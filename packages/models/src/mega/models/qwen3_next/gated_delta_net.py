"""Gated DeltaNet linear attention (Qwen3-Next's linear layers), written for one device.

    [q k v z] = in_proj_qkvz(x)      [b a] = in_proj_ba(x)       (grouped by key head)
    q k v     = silu(causal depthwise conv1d([q k v]))            (width --linear-conv-kernel-dim)
    beta      = sigmoid(b)           g = -exp(A_log) * softplus(a + dt_bias)
    o         = gated delta rule(l2norm(q) / sqrt(dk), l2norm(k), v, g, beta)   (mega.models.qwen3_next.delta_rule)
    out       = out_proj(out_norm(o, gate=z))

Each key head serves ``--linear-num-value-heads / --linear-num-key-heads`` value heads. Parameter
names (under ``decoder.layers.N.self_attention.``) and layouts, every one grouped by key head so
that tensor parallelism splits each into whole key heads with their value heads:

    in_proj_qkvz.weight  [key heads * (2 dk + 2 r dv), h]   per key head [q; k; v (r heads); z (r heads)]
    in_proj_ba.weight    [key heads * 2 r, h]               per key head [b (r); a (r)]
    conv1d.weight        [key heads * (2 dk + r dv), 1, width]  per key head [q; k; v]
    A_log, dt_bias       [value heads]
    out_norm.weight      [dv]                                (shared by the heads)
    out_proj.weight      [h, value heads * dv]

(Hugging Face holds the projections in the same layout; its conv1d channels are all queries,
then all keys, then all values: the mapping regroups them.)

Generation: the layer's ``inference_cache`` holds a fixed-size state per sequence instead of
keys and values: the last ``width - 1`` inputs of the convolution and the delta rule's state
``[value heads, dk, dv]``. It gives ``read(conv_shape, state_shape, dtype)`` -> the bound rows'
``(conv [b, C, width - 1], state [b, heads, dk, dv])`` (zeros for a sequence just started),
``real_lengths`` (``[b]`` tokens of each row that are its own, right-padded prompts; None: all)
and ``write(conv, state)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mega.core.kernels import Kernels
from mega.models.qwen3_next.config import HybridLinearAttentionConfig
from mega.models.qwen3_next.delta_rule import (
    chunked_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from mega.models.qwen3_next.norms import GatedRMSNorm


class GatedDeltaNet(nn.Module):
    def __init__(self, config: HybridLinearAttentionConfig, kernels: Kernels):
        super().__init__()
        self.config = config
        keys, values = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.dk, self.dv, self.values_per_key = dk, dv, values // keys
        self.width = config.linear_conv_kernel_dim
        r = self.values_per_key
        self.in_proj_qkvz = kernels.linear(config.hidden_size, keys * (2 * dk + 2 * r * dv), bias=False)
        self.in_proj_ba = kernels.linear(config.hidden_size, keys * 2 * r, bias=False)
        channels = keys * (2 * dk + r * dv)
        self.conv1d = nn.Conv1d(channels, channels, self.width, groups=channels, bias=False)
        self.A_log = nn.Parameter(torch.zeros(values))
        self.dt_bias = nn.Parameter(torch.ones(values))
        self.out_norm = GatedRMSNorm(dv, config.layernorm_epsilon)
        self.out_proj = kernels.linear(values * dv, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None, inference_cache=None,
                **unused) -> torch.Tensor:
        """``hidden`` ``[s, b, h]``; positions, masks and RoPE angles are the full attention's."""
        dk, dv, r = self.dk, self.dv, self.values_per_key
        qkvz = self.in_proj_qkvz(hidden)
        seq, batch, _ = qkvz.shape  # the whole sequence (under sequence parallelism the input is a slice)
        groups = qkvz.shape[-1] // (2 * dk + 2 * r * dv)  # this rank's key heads
        qkvz = qkvz.view(seq, batch, groups, 2 * dk + 2 * r * dv)
        mixed, z = qkvz.split([2 * dk + r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(hidden).view(seq, batch, groups, 2 * r).split([r, r], dim=-1)
        heads = groups * r

        mixed = mixed.reshape(seq, batch, -1).permute(1, 2, 0)  # [b, channels, s]
        state = real = None
        if inference_cache is not None:
            if not hasattr(inference_cache, "read"):
                raise TypeError(f"{type(inference_cache).__name__} holds keys and values only; a Gated DeltaNet layer "
                                "generates with a recurrent-state cache (mega.inference's RecurrentStateCache)")
            real = inference_cache.real_lengths
            conv_state, state = inference_cache.read((batch, mixed.shape[1], self.width - 1), (batch, heads, dk, dv),
                                                     mixed.dtype)
            mixed = torch.cat([conv_state.to(mixed.dtype), mixed], dim=-1)
        else:
            mixed = F.pad(mixed, (self.width - 1, 0))
        convolved = F.silu(F.conv1d(mixed, self.conv1d.weight, groups=mixed.shape[1]))  # [b, channels, s]
        query, key, value = convolved.view(batch, groups, 2 * dk + r * dv, seq).split([dk, dk, r * dv], dim=2)
        query, key = (t.transpose(-1, -2).repeat_interleave(r, dim=1) for t in (query, key))  # [b, heads, s, dk]
        value = value.unflatten(2, (r, dv)).flatten(1, 2).transpose(-1, -2)  # [b, heads, s, dv]
        query = l2_normalize(query.float()) * dk ** -0.5
        key = l2_normalize(key.float())
        beta = torch.sigmoid(b.float()).reshape(seq, batch, heads).permute(1, 2, 0)  # [b, heads, s]
        g = (-self.A_log.float().exp() * F.softplus(a.float().reshape(seq, batch, heads) + self.dt_bias.float()))
        g = g.permute(1, 2, 0)
        if real is not None:  # right padding: positions past a row's own tokens leave its state as it is
            own = (torch.arange(seq, device=hidden.device)[None, :] < real[:, None])[:, None, :]
            beta, g = beta * own, g * own
        if seq == 1 and state is not None:
            out, final = recurrent_gated_delta_rule(query, key, value, g, beta, state)
        else:
            out, final = chunked_gated_delta_rule(query, key, value, g, beta, state,
                                                  self.config.gated_delta_rule_chunk_size)
        if inference_cache is not None:
            inference_cache.write(self._conv_tail(mixed, real, seq), final)
        out = out.to(hidden.dtype).permute(2, 0, 1, 3)  # [s, b, heads, dv]
        out = self.out_norm(out, z.reshape(seq, batch, heads, dv))
        return self.out_proj(out.reshape(seq, batch, heads * dv))

    def _conv_tail(self, mixed: torch.Tensor, real: torch.Tensor | None, seq: int) -> torch.Tensor:
        """The convolution's next state: each row's last ``width - 1`` inputs (its own tokens')."""
        keep = self.width - 1
        if real is None:
            return mixed[..., mixed.shape[-1] - keep:]
        ends = real[:, None] + torch.arange(keep, device=mixed.device)[None, :]  # into [state; new]
        return mixed.gather(2, ends[:, None, :].expand(-1, mixed.shape[1], -1))
