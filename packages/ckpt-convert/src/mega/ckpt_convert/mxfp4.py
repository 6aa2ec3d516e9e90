"""MXFP4 weights (the OCP microscaling format gpt-oss's experts ship in), dequantized on import.

A tensor ``W`` [..., rows, columns] is stored as two uint8 tensors (transformers' Mxfp4 layout):

    W_blocks  [..., rows, columns / 32, 16]   two e2m1 values a byte, the low nibble first
    W_scales  [..., rows, columns / 32]       one e8m0 exponent per block of 32 values

An e2m1 nibble is sign (bit 3), exponent (bits 2-1, bias 1) and mantissa (bit 0): a subnormal
``m / 2`` where the exponent is 0, else ``2^(e - 1) * (1 + m / 2)``; so the sixteen values are
+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}. A block's value is the nibble's times ``2^(scale - 127)``.

gpt-oss stores its experts' projections this way as ``[experts, out, in]``, the transpose of the
unquantized ``gate_up_proj`` / ``down_proj`` ([experts, in, out]); :class:`MXFP4Weights` shows a
directory's files with each such pair as that unquantized tensor, so a family's mapping reads it
as it reads an unquantized checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

BLOCK = 32  # values a scale covers
SCALE_BIAS = 127  # e8m0
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def e2m1_values() -> torch.Tensor:
    """The value of each of the 16 nibbles, as float32."""
    values = []
    for nibble in range(16):
        sign = -1.0 if nibble & 0b1000 else 1.0
        exponent, mantissa = (nibble >> 1) & 0b11, nibble & 0b1
        magnitude = mantissa / 2 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
        values.append(sign * magnitude)
    return torch.tensor(values, dtype=torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks`` [..., groups, 16] uint8 and ``scales`` [..., groups] uint8 -> [..., groups * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair: blocks "
                         f"are [..., groups, {BLOCK // 2}], scales [..., groups]")
    table = e2m1_values()
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., groups, 32], the low nibble first
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents[..., None]).flatten(-2).to(dtype)


def is_mxfp4(config_json: Mapping[str, Any]) -> bool:
    quantization = config_json.get("quantization_config") or {}
    return quantization.get("quant_method") == "mxfp4"


class MXFP4Weights:
    """A directory's weights (:class:`~mega.ckpt_convert.hf_weights.HFWeights`) with every
    ``X_blocks`` / ``X_scales`` pair shown as the tensor ``X`` [..., in, out] in ``dtype``,
    dequantized when read."""

    def __init__(self, weights, dtype: torch.dtype):
        self._weights, self.dtype_of_dequantized = weights, dtype
        names = set(weights.names())
        self.quantized = sorted(name.removesuffix(BLOCKS_SUFFIX) for name in names
                                if name.endswith(BLOCKS_SUFFIX) and name.removesuffix(BLOCKS_SUFFIX) + SCALES_SUFFIX in names)
        paired = {name + suffix for name in self.quantized for suffix in (BLOCKS_SUFFIX, SCALES_SUFFIX)}
        self._plain = [name for name in weights.names() if name not in paired]

    def names(self) -> list[str]:
        return self._plain + self.quantized

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.quantized:
            return self._weights.shape(name)
        *prefix, rows, groups, _ = self._weights.shape(name + BLOCKS_SUFFIX)
        return (*prefix, groups * BLOCK, rows)

    def dtype(self, name: str) -> torch.dtype:
        return self.dtype_of_dequantized if name in self.quantized else self._weights.dtype(name)

    def file(self, name: str):
        return self._weights.file(name + BLOCKS_SUFFIX if name in self.quantized else name)

    def read(self, name: str) -> torch.Tensor:
        if name not in self.quantized:
            return self._weights.read(name)
        dequantized = dequantize_mxfp4(self._weights.read(name + BLOCKS_SUFFIX), self._weights.read(name + SCALES_SUFFIX),
                                       self.dtype_of_dequantized)
        return dequantized.transpose(-1, -2).contiguous()

    def close(self) -> None:
        self._weights.close()


def dequantizing(weights, config_json: Mapping[str, Any]) -> tuple[Any, str | None]:
    """``weights`` as read, or, for an MXFP4 checkpoint, through :class:`MXFP4Weights` in the dtype
    of its unquantized tensors; and what to tell the user."""
    if not is_mxfp4(config_json):
        return weights, None
    floating = [weights.dtype(name) for name in weights.names() if weights.dtype(name).is_floating_point]
    view = MXFP4Weights(weights, floating[0] if floating else torch.bfloat16)
    if not view.quantized:
        return view, None
    dtype = str(view.dtype_of_dequantized).removeprefix("torch.")
    return view, (f"{len(view.quantized)} tensors stored as MXFP4 blocks and scales (quantization_config "
                  f"mxfp4) were dequantized to {dtype} on import: {view.quantized[0]}, ...; an export writes "
                  "them unquantized")
