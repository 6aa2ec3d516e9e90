"""Rotary position embeddings (RoPE) in the rotate-half layout Megatron and Hugging Face share.

The head dimension is split in two halves that rotate together (not interleaved pairs), so
checkpoints of either map without permuting the query/key rows.

The angles are the same in every layer, so a model makes them once per forward
(:func:`model_rotary_angles`, in the run's dtype) and hands them to each layer's attention, which
takes its rows (:func:`layer_cos_sin`); an attention called alone computes its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from mega.models.config import TransformerConfig


def plain_inverse_frequencies(base: float, dim: int, device: torch.device) -> torch.Tensor:
    """``base^(-2i / dim)`` for the ``dim / 2`` rotating pairs, fp32."""
    return 1.0 / base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)


def inverse_frequencies(config: TransformerConfig, device: torch.device, dim: int | None = None,
                        seq_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The frequencies of ``--rope-type`` over ``dim`` channels (default ``--kv-channels``):
    ``[dim / 2]``, or for dynamic scaling with ``seq_lengths`` ``[b, dim / 2]`` (each row's own)."""
    dim = config.kv_channels if dim is None else dim
    kind = getattr(config, "rope_type", "rope")
    if kind == "dynamic":
        return _dynamic_ntk(config, dim, device, seq_lengths)
    inv_freq = plain_inverse_frequencies(config.rotary_base, dim, device)
    if kind == "linear":
        return inv_freq / config.rotary_scaling_factor
    if kind == "llama3":
        return _llama3_scaling(inv_freq, config)
    if kind == "yarn":
        return yarn_inverse_frequencies(config, device, dim)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Slow the low frequencies by ``--rope-scaling-factor``, keep the high ones, blend smoothly
    in between (wavelengths measured against the original context)."""
    factor, low, high = config.rope_scaling_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
    context = config.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    in_between = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(in_between, blended, scaled)


def _dynamic_ntk(config: TransformerConfig, dim: int, device: torch.device,
                 seq_lengths: torch.Tensor | None) -> torch.Tensor:
    """NTK-aware dynamic scaling: past the original context, the base grows with the sequence
    length ``L`` to ``base * (factor * L / original - (factor - 1)) ^ (dim / (dim - 2))``, in
    fp32 as transformers computes it; within the original context the plain frequencies."""
    original = config.original_max_position_embeddings or config.max_position_embeddings
    plain = plain_inverse_frequencies(config.rotary_base, dim, device)
    if seq_lengths is None or bool((seq_lengths <= original).all()):
        return plain
    factor = config.rotary_scaling_factor
    lengths = seq_lengths.to(device=device, dtype=torch.float32).clamp(min=original)[:, None]  # [b, 1]
    base = config.rotary_base * ((factor * lengths / original) - (factor - 1)) ** (dim / (dim - 2))
    scaled = 1.0 / base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    return torch.where(seq_lengths.to(device)[:, None] > original, scaled, plain)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inverse_frequencies(config, device: torch.device, dim: int) -> torch.Tensor:
    """YaRN's frequencies for ``dim`` rope channels: the original ones for short wavelengths,
    divided by ``--rotary-scaling-factor`` for long ones, a linear ramp between the dimensions
    ``--beta-fast`` and ``--beta-slow`` rotations over ``--original-max-position-embeddings``
    (rounded outwards to whole dimensions unless ``--no-yarn-truncate``, as gpt-oss's). Plain
    frequencies unless ``--rope-type yarn``."""
    base, factor = config.rotary_base, config.rotary_scaling_factor
    extrapolation = plain_inverse_frequencies(base, dim, device)
    if config.rope_type != "yarn":
        return extrapolation
    original = config.original_max_position_embeddings or config.max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(config.beta_fast), correction_dim(config.beta_slow)
    if getattr(config, "yarn_truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return extrapolation / factor * ramp + extrapolation * (1 - ramp)


def rotary_attention_factor(config: TransformerConfig) -> float:
    """The factor on cos and sin: YaRN's attention factor (``--rope-attention-factor``, else
    mscale(--mscale) / mscale(--mscale-all-dim) where both are set, else mscale(factor), as
    transformers' YaRN); 1 for the other kinds."""
    if getattr(config, "rope_type", "rope") != "yarn":
        return 1.0
    if config.rope_attention_factor is not None:
        return config.rope_attention_factor
    factor = config.rotary_scaling_factor
    if config.mscale and config.mscale_all_dim:
        return yarn_mscale(factor, config.mscale) / yarn_mscale(factor, config.mscale_all_dim)
    return yarn_mscale(factor)


def scaled_cos_sin(inv_freq: torch.Tensor, factor: float, seq_length: int, position_ids: torch.Tensor | None,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[seq, batch or 1, 1, d / 2]`` of the angles at ``position_ids`` (default
    ``0 .. seq_length - 1``) with ``inv_freq`` (``[d / 2]``, or ``[batch, d / 2]``: each row its
    own), each times the attention ``factor``."""
    if position_ids is None:
        positions = torch.arange(seq_length, device=device, dtype=torch.float32)[:, None]  # [s, 1]
    else:
        positions = position_ids.to(device=device, dtype=torch.float32).t()  # [b, s] -> [s, b]
    angles = (positions[..., None] * inv_freq)[:, :, None, :]  # [s, b, 1, d/2]
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


def rotary_cos_sin(
    config: TransformerConfig, seq_length: int, position_ids: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, fp32, shaped ``[seq, batch or 1, 1, head_dim / 2]``
    (one value per rotating pair: both halves of the head turn by the same angles), of
    ``--rope-type``'s frequencies and attention factor.

    Dynamic scaling takes the sequence length a forward sees, as transformers: each row's last
    position + 1 (``position_ids``; a forward with a KV cache rotates its new keys so, the cached
    ones keep the angles they were rotated with), else ``seq_length``."""
    seq_lengths = None
    if getattr(config, "rope_type", "rope") == "dynamic":
        seq_lengths = (torch.tensor([seq_length], device=device) if position_ids is None
                       else position_ids.to(device).amax(dim=-1) + 1)
    inv_freq = inverse_frequencies(config, device, seq_lengths=seq_lengths)
    if inv_freq.dim() == 2 and position_ids is None:
        inv_freq = inv_freq[0]
    return scaled_cos_sin(inv_freq, rotary_attention_factor(config), seq_length, position_ids, device)


# cos, sin: as made by rotary_cos_sin (or an attention's own such function).
RotaryAngles = tuple[torch.Tensor, torch.Tensor]
CosSin = Callable[[TransformerConfig, int, "torch.Tensor | None", torch.device], RotaryAngles]


def model_rotary_angles(config: TransformerConfig, cos_sin: CosSin, seq_length: int,
                        position_ids: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> RotaryAngles:
    """cos and sin of a whole forward, made once by ``cos_sin`` and cast once to ``dtype`` (the
    dtype the layers' queries and keys have), for every layer's :func:`layer_cos_sin`.

    Without ``position_ids`` the table covers positions ``0 .. max(seq_length, --seq-length) - 1``
    and each layer takes the first rows its sequence needs: a later pipeline stage under
    sequence parallelism sees only its slice of the sequence, the attention the whole of it."""
    if position_ids is None:
        seq_length = max(seq_length, config.seq_length)
    cos, sin = cos_sin(config, seq_length, position_ids, device)
    return cos.to(dtype), sin.to(dtype)


def layer_cos_sin(config: TransformerConfig, cos_sin: CosSin, angles: RotaryAngles | None, seq_length: int,
                  position_ids: torch.Tensor | None, device: torch.device) -> RotaryAngles:
    """One layer's cos and sin ``[seq_length, batch or 1, 1, d / 2]``: the rows of the model's
    ``angles`` (:func:`model_rotary_angles`), or, where a layer runs alone or the table is too
    short, made here by ``cos_sin``."""
    if angles is None or (position_ids is None and angles[0].shape[0] < seq_length):
        return cos_sin(config, seq_length, position_ids, device)
    cos, sin = angles
    return (cos[:seq_length], sin[:seq_length]) if position_ids is None else (cos, sin)
