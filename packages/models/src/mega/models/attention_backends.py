"""The default attention kernel backend: torch's ``scaled_dot_product_attention``.

torch picks its fastest kernel for the device (flash or memory-efficient on GPUs, a fused C++
kernel on CPUs). Registered as ``sdpa`` by this package's plugin; see :mod:`mega.core.kernels`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Only the CUDA flash kernel takes fewer key/value heads natively (torch >= 2.5); elsewhere
# ``enable_gqa`` falls back to the unfused math kernel, slower than repeating the heads.
NATIVE_GQA_DTYPES = (torch.float16, torch.bfloat16)


class SdpaAttention:
    name = "sdpa"
    kind = "attention"

    def is_available(self) -> tuple[bool, str]:
        return True, ""

    def attention(self, query, key, value, *, causal: bool, dropout_p: float, softmax_scale: float | None):
        repeats = query.shape[1] // key.shape[1]
        native_gqa = query.is_cuda and query.dtype in NATIVE_GQA_DTYPES
        if repeats > 1 and not native_gqa:
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=causal, dropout_p=dropout_p, scale=softmax_scale,
            enable_gqa=repeats > 1 and native_gqa,
        )


SDPA = SdpaAttention()
