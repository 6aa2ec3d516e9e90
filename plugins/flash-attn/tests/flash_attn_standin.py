"""For tests only: plain-torch stand-ins for flash-attention's documented functions.

CI has neither flash-attention nor a GPU. These modules implement the call signatures and
conventions the adapters rely on (``[batch, seq, heads, d]`` layout, packed ``[tokens, heads,
d]`` with ``cu_seqlens``, fewer key/value heads, causal aligned bottom-right, the log-sum-exp
returned with ``return_attn_probs``, +inf log-sum-exp for a query that sees no key, the private
backward writing into ``dq``/``dk``/``dv`` and needing head dims in multiples of 8), so a test
that installs them into ``sys.modules`` checks the adapters' plumbing. They say nothing about
the real kernels: on a GPU with flash-attention installed the same tests run against it.
"""

from __future__ import annotations

import math
import sys
import types

import torch


def _allowed(q_len: int, k_len: int, causal: bool, device) -> torch.Tensor:
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    return allowed.tril(k_len - q_len) if causal else allowed


def _scores(q, k, softmax_scale, causal):
    """Scaled scores ``[b, h, q, k]`` of ``[b, s, h, d]`` inputs, masked with -inf; GQA by the
    documented mapping (query head i reads key head i // (heads // kv_heads))."""
    repeats = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(repeats, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * softmax_scale
    allowed = _allowed(q.shape[1], k.shape[1], causal, q.device)
    return scores.masked_fill(~allowed, float("-inf"))


def dense_attention(calls, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    calls.append(("flash_attn_func", tuple(q.shape), tuple(k.shape), dropout_p, causal))
    assert q.dim() == 4 and k.shape[2] == v.shape[2] and q.shape[2] % k.shape[2] == 0, "layout [b, s, h, d]"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "last dimension must be contiguous"
    softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = _scores(q, k, softmax_scale, causal)
    lse = torch.logsumexp(scores, dim=-1)  # [b, h, q]
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees no key: output 0
    if dropout_p > 0:  # torch's default generator of the device, as flash-attention's philox seed
        probs = probs * (torch.rand(probs.shape, device=probs.device) >= dropout_p) / (1.0 - dropout_p)
    repeats = q.shape[2] // v.shape[2]
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float().repeat_interleave(repeats, dim=2)).to(q.dtype)
    if not return_attn_probs:
        return out
    return out, lse.masked_fill(lse == float("-inf"), float("inf")).detach(), None


def varlen_attention(calls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                     softmax_scale=None, causal=False, **options):
    calls.append(("flash_attn_varlen_func", tuple(q.shape), tuple(k.shape), dropout_p, causal))
    assert q.dim() == 3 and cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q == max(b - a for a, b in zip(bounds_q, bounds_q[1:], strict=False))
    assert max_seqlen_k == max(b - a for a, b in zip(bounds_k, bounds_k[1:], strict=False))
    outs = [dense_attention([], q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], dropout_p, softmax_scale, causal)[0]
            for qa, qb, ka, kb in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:], strict=False)]
    return torch.cat(outs)


def private_backward(calls, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                     window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    """flash-attn 2.7's ``_flash_attn_backward``: gradients of one block given the final
    ``out``/``softmax_lse`` (+inf for a query that sees no key), written into ``dq``/``dk``/``dv``."""
    calls.append(("_flash_attn_backward", tuple(q.shape), tuple(k.shape), causal))
    assert q.shape[-1] % 8 == 0, "the private kernels take head dims in multiples of 8"
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == q.shape[:1] + q.shape[2:3] + q.shape[1:2]
    repeats = q.shape[2] // k.shape[2]
    scores = _scores(q, k, softmax_scale, causal)
    probs = torch.exp(scores - softmax_lse.unsqueeze(-1))  # masked: exp(-inf) = 0
    dout32, v32 = dout.float(), v.float().repeat_interleave(repeats, dim=2)
    grad_v = torch.einsum("bhqk,bqhd->bkhd", probs, dout32)
    grad_probs = torch.einsum("bqhd,bkhd->bhqk", dout32, v32)
    delta = (dout32 * out.float()).sum(-1).transpose(1, 2).unsqueeze(-1)  # [b, h, q, 1]
    grad_scores = probs * (grad_probs - delta) * softmax_scale
    grad_q = torch.einsum("bhqk,bkhd->bqhd", grad_scores, k.float().repeat_interleave(repeats, dim=2))
    grad_k = torch.einsum("bhqk,bqhd->bkhd", grad_scores, q.float())
    b, s, h, d = grad_k.shape
    dq.copy_(grad_q)
    dk.copy_(grad_k.view(b, s, h // repeats, repeats, d).sum(3))
    dv.copy_(grad_v.view(b, s, h // repeats, repeats, d).sum(3))
    return delta


def install(monkeypatch, hopper: bool = False) -> types.ModuleType:
    """Put stand-ins for ``flash_attn`` (2.7) and ``flash_attn.flash_attn_interface`` into
    ``sys.modules`` (and FA3's ``flash_attn_interface`` when ``hopper``) for one test; the
    modules' ``calls`` list records each call with its shapes."""
    calls: list = []
    fa2 = types.ModuleType("flash_attn")
    fa2.__version__ = "2.7.4.post1"
    fa2.calls = calls
    fa2.flash_attn_func = lambda *args, **kwargs: dense_attention(calls, *args, **kwargs)
    fa2.flash_attn_varlen_func = lambda *args, **kwargs: varlen_attention(calls, *args, **kwargs)
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_backward = lambda *args, **kwargs: private_backward(calls, *args, **kwargs)
    fa2.flash_attn_interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", fa2)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    if hopper:
        fa3 = types.ModuleType("flash_attn_interface")

        def fa3_dense(q, k, v, softmax_scale=None, causal=False, **options):
            calls.append(("fa3",))
            return dense_attention([], q, k, v, 0.0, softmax_scale, causal)

        def fa3_varlen(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q=None, seqused_k=None, softmax_scale=None,
                       causal=False, **options):
            calls.append(("fa3_varlen",))
            return varlen_attention([], q, k, v, cu_q, cu_k, max_q, max_k, 0.0, softmax_scale, causal)

        fa3.flash_attn_func, fa3.flash_attn_varlen_func = fa3_dense, fa3_varlen
        monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
    else:
        monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)
    return fa2
