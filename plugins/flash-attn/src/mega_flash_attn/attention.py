"""The ``attention`` and ``block_attention`` components on flash-attention.

mega's kernels take ``[batch, heads, seq, head_dim]``; flash-attention takes ``[batch, seq,
heads, head_dim]`` (packed sequences: ``[tokens, heads, head_dim]``), so the adapters transpose
views in and out (no copy: flash-attention needs only the last dimension contiguous). Keys and
values keep their fewer heads (flash-attention maps query head ``i`` to key head
``i // (heads // kv_heads)``, as mega does). Its causal mask is aligned at the bottom right, as
``AttentionMask.causal`` is. Dropout draws its seed from torch's CUDA generator, so the
caller's RNG fork (tensor-parallel dropout) governs it as it does torch's.

What flash-attention cannot express runs torch's sdpa (the ``torch`` backend) instead: an
additive bias, and a padding mask together with a causal one or packed sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mega.core.kernels import AttentionMask
from mega.models.torch_kernels import sdpa_attention

# flash-attention's kernels take head dimensions in multiples of 8; its public functions pad,
# the private backward that block attention calls does not.
HEAD_DIM_MULTIPLE = 8


class FlashAttention:
    """``fn(query, key, value, *, mask, dropout_p, softmax_scale)`` (the ``attention`` kind).

    ``fa2`` is the ``flash_attn`` module; ``fa3`` FA3's ``flash_attn_interface`` (or None), used
    when no dropout is asked for (FA3 has none).
    """

    def __init__(self, fa2, fa3=None):
        self.fa2, self.fa3 = fa2, fa3

    def __call__(self, query, key, value, *, mask: AttentionMask, dropout_p: float = 0.0,
                 softmax_scale: float | None = None):
        if not _expressible(mask, query, key):
            return sdpa_attention(query, key, value, mask=mask, dropout_p=dropout_p, softmax_scale=softmax_scale)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [b, s, h, d] views
        if mask.cu_seqlens is not None:
            rows = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]  # the rows end to end: [b * s, h, d]
            out = self._packed(*rows, mask.cu_seqlens, mask.causal, dropout_p, softmax_scale).view(q.shape)
        elif mask.padding is not None:
            out = self._padded_keys(q, k, v, mask.padding, dropout_p, softmax_scale)
        else:
            out = self._dense(q, k, v, mask.causal, dropout_p, softmax_scale)
        return out.transpose(1, 2)

    def _dense(self, q, k, v, causal, dropout_p, softmax_scale):
        if self.fa3 is not None and dropout_p == 0.0:
            return _output(self.fa3.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal))
        return self.fa2.flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal)

    def _packed(self, q, k, v, cu_seqlens, causal, dropout_p, softmax_scale):
        """Sequences laid end to end (``[tokens, heads, d]``); none attends to another."""
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return self._varlen(q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal, dropout_p, softmax_scale)

    def _padded_keys(self, q, k, v, padding, dropout_p, softmax_scale):
        """Every query of row ``b`` sees the real keys of row ``b``: the keys are packed without
        their padding, the queries keep their places."""
        batch, q_len = q.shape[:2]
        padding = padding.to(device=q.device, dtype=torch.bool)
        lengths = padding.sum(dim=1, dtype=torch.int32)
        cu_k = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=q.device)
        out = self._varlen(q.reshape(batch * q_len, *q.shape[2:]), k[padding], v[padding], cu_q, cu_k,
                           q_len, int(lengths.max()), False, dropout_p, softmax_scale)
        return out.view(batch, q_len, *out.shape[1:])

    def _varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p, softmax_scale):
        if self.fa3 is not None and dropout_p == 0.0:
            return _output(self.fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                           softmax_scale=softmax_scale, causal=causal))
        return self.fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p,
                                               softmax_scale=softmax_scale, causal=causal)


def _expressible(mask: AttentionMask, query, key) -> bool:
    if mask.bias is not None:
        return False
    if mask.padding is not None:
        return not mask.causal and mask.cu_seqlens is None
    if mask.cu_seqlens is not None:  # packed training: the rows end to end, as many queries as keys
        return query.shape[2] == key.shape[2]
    return True


def _output(result):
    """FA3's functions returned ``(out, lse)`` in early releases and ``out`` since."""
    return result[0] if isinstance(result, tuple) else result


class FlashBlockAttention:
    """The ``block_attention`` kind: flash-attention's forward returning the log-sum-exp and its
    backward taking the final output and log-sum-exp (what ring attention merges blocks with).

    ``fa2`` is ``flash_attn``; ``interface`` is ``flash_attn.flash_attn_interface``, whose
    ``_flash_attn_backward`` (flash-attn >= 2.7 keyword names) computes one block's gradients.
    """

    def __init__(self, fa2, interface):
        self.fa2, self.interface = fa2, interface

    def forward(self, query, key, value, *, causal: bool, softmax_scale: float):
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        with torch.no_grad():
            out, lse, _ = self.fa2.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=softmax_scale,
                                                   causal=causal, return_attn_probs=True)
        # A query that sees no key of this block: flash-attention says +inf (so its backward
        # weighs nothing), mega's contract -inf (so merging ignores the block).
        lse = lse.masked_fill(lse == float("inf"), float("-inf"))
        return out.transpose(1, 2), lse

    def backward(self, grad_out, query, key, value, out, lse, *, causal: bool, softmax_scale: float):
        head_dim = query.shape[-1]
        dout, q, k, v, o = (_pad_head(t.transpose(1, 2)) for t in (grad_out, query, key, value, out))
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        lse = lse.float().masked_fill(lse == float("-inf"), float("inf")).contiguous()
        self.interface._flash_attn_backward(
            dout, q, k, v, o, lse, dq, dk, dv, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
            rng_state=None)
        return tuple(t[..., :head_dim].transpose(1, 2) for t in (dq, dk, dv))


def _pad_head(t: torch.Tensor) -> torch.Tensor:
    extra = -t.shape[-1] % HEAD_DIM_MULTIPLE
    return F.pad(t, (0, extra)) if extra else t
