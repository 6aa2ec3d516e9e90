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

# LLaMA-3.1's frequency scaling keeps these fixed (Megatron's and Hugging Face's defaults).
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_CONTEXT = 8192


def inverse_frequencies(config: TransformerConfig, device: torch.device) -> torch.Tensor:
    dim = config.kv_channels
    inv_freq = 1.0 / config.rotary_base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    if config.use_rope_scaling:
        inv_freq = _llama3_scaling(inv_freq, config.rope_scaling_factor)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Slow the low frequencies by ``factor``, keep the high ones, blend smoothly in between."""
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_LOW_FREQ_FACTOR
    high_freq_wavelength = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_HIGH_FREQ_FACTOR
    smooth = (LLAMA3_ORIGINAL_CONTEXT / wavelength - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR
    )
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    in_between = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(in_between, blended, scaled)


def rotary_cos_sin(
    config: TransformerConfig, seq_length: int, position_ids: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, fp32, shaped ``[seq, batch or 1, 1, head_dim / 2]``
    (one value per rotating pair: both halves of the head turn by the same angles)."""
    inv_freq = inverse_frequencies(config, device)
    if position_ids is None:
        positions = torch.arange(seq_length, device=device, dtype=torch.float32)[:, None]  # [s, 1]
    else:
        positions = position_ids.to(device=device, dtype=torch.float32).t()  # [b, s] -> [s, b]
    angles = (positions[..., None] * inv_freq)[:, :, None, :]  # [s, b, 1, d/2]
    return angles.cos(), angles.sin()


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
