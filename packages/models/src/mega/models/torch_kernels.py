"""The ``torch`` kernel backend: torch-native components of every kind but ``norm_linear``.

Registered by this package's plugin as ``torch``; the default for every kind (see
:mod:`mega.core.kernels` for the contract of each). Attention is torch's
``scaled_dot_product_attention``, which picks its fastest kernel for the device (flash or
memory-efficient on GPUs, a fused C++ kernel on CPUs).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from mega.core.kernels import AttentionMask
from mega.core.parallel.cross_entropy import cross_entropy
from mega.core.parallel.grad_accumulation_fusion import Linear

# Only the CUDA flash kernel takes fewer key/value heads natively (torch >= 2.5); elsewhere
# ``enable_gqa`` falls back to the unfused math kernel, slower than repeating the heads.
NATIVE_GQA_DTYPES = (torch.float16, torch.bfloat16)


def sdpa_attention(query, key, value, *, mask: AttentionMask, dropout_p: float = 0.0,
                   softmax_scale: float | None = None):
    repeats = query.shape[1] // key.shape[1]
    if repeats > 1 and query.shape[2] == 1:
        return _one_query_per_head(query, key, value, mask, dropout_p, softmax_scale, repeats)
    native_gqa = query.is_cuda and query.dtype in NATIVE_GQA_DTYPES
    if repeats > 1 and not native_gqa:
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    if _documents_apart(mask, query, key):
        return _per_document(query, key, value, mask, dropout_p, softmax_scale, repeats > 1 and native_gqa)
    attn_mask = explicit_mask(mask, query, key)
    # sdpa's is_causal aligns the mask at the top left; an explicit mask serves the other cases.
    is_causal = mask.causal and attn_mask is None
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p, scale=softmax_scale,
        enable_gqa=repeats > 1 and native_gqa,
    )


def _documents_apart(mask: AttentionMask, query: torch.Tensor, key: torch.Tensor) -> bool:
    """Packed documents and nothing else to mask (no cache: as many queries as keys): they are
    attended one batch row per document (:func:`_per_document`), not through a mask over the
    whole row, whose size grows with the square of the row and leaves SDPA unfused. Not inside
    a graph ``--compile`` traces: the documents' lengths are read on the host (a graph break, and
    shapes that change with every batch)."""
    return (mask.cu_seqlens is not None and mask.padding is None and mask.bias is None
            and query.shape[2] == key.shape[2] and not torch.compiler.is_compiling())


def _per_document(query, key, value, mask: AttentionMask, dropout_p: float, softmax_scale: float | None,
                  enable_gqa: bool) -> torch.Tensor:
    """Attention within each packed document: the documents gathered into rows of their own,
    right-padded to the longest (causal: a real query sees only earlier keys of its row, so the
    padding needs no mask; bidirectional: the padded keys are masked), and the outputs put back
    where their tokens sit. Tokens after the last document's end form one more document."""
    batch, _, length, _ = query.shape
    total = batch * length
    bounds = [0, *(b for b in mask.cu_seqlens.tolist() if 0 < b < total), total]  # one host read per layer
    spans = [(start, end - start) for start, end in zip(bounds, bounds[1:], strict=False) if end > start]
    longest = max(size for _, size in spans)
    device = query.device
    offsets = torch.arange(longest, device=device)
    starts = torch.tensor([start for start, _ in spans], device=device)
    sizes = torch.tensor([size for _, size in spans], device=device)
    real = offsets[None, :] < sizes[:, None]  # [documents, longest]
    where = (starts[:, None] + offsets[None, :]).clamp(max=total - 1)  # each slot's token (padding: any)

    def rows(tensor: torch.Tensor) -> torch.Tensor:  # [batch, heads, length, dim] -> [documents, heads, longest, dim]
        tokens = tensor.transpose(1, 2).reshape(total, tensor.shape[1], tensor.shape[3])
        return tokens[where].transpose(1, 2)

    attn_mask = None if mask.causal else real[:, None, None, :]
    out = F.scaled_dot_product_attention(rows(query), rows(key), rows(value), attn_mask=attn_mask,
                                         is_causal=mask.causal, dropout_p=dropout_p, scale=softmax_scale,
                                         enable_gqa=enable_gqa)
    heads, dim = out.shape[1], out.shape[3]
    # Every token is one real slot: put the slots back in token order.
    placed = out.transpose(1, 2)[real]  # [total, heads, dim], documents in token order
    return placed.reshape(batch, length, heads, dim).transpose(1, 2)


def _one_query_per_head(query, key, value, mask: AttentionMask, dropout_p: float, softmax_scale: float | None,
                        repeats: int) -> torch.Tensor:
    """A decode step's grouped-query attention, one query per head: a group's query heads become
    query positions of its one key/value head. They all see the same keys (the mask of a single
    query has no per-query part), so the fused kernels take the step, mask included, without the
    keys and values repeated per query head (``enable_gqa`` with a mask leaves torch's SDPA on
    its unfused math path)."""
    batch, heads, _, dim = query.shape
    # The one query sits after every key (causal masks align at the bottom right): causal hides none.
    attn_mask = explicit_mask(dataclasses.replace(mask, causal=False), query, key)  # [b or 1, h or 1, 1, keys]
    if attn_mask is not None and attn_mask.shape[1] == heads:  # a per-head bias follows its head
        attn_mask = attn_mask.reshape(attn_mask.shape[0], heads // repeats, repeats, attn_mask.shape[-1])
    grouped = query.reshape(batch, heads // repeats, repeats, dim)  # heads are group-major
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                         scale=softmax_scale)
    return out.reshape(batch, heads, 1, dim)


def explicit_mask(mask: AttentionMask, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """An additive float mask ``[batch or 1, heads or 1, q, k]``, or None when ``is_causal``
    (queries and keys of one length) or nothing at all is needed."""
    q_len, k_len = query.shape[2], key.shape[2]
    needs_causal = mask.causal and q_len != k_len
    if mask.padding is None and mask.cu_seqlens is None and not needs_causal:
        # Nothing to combine: the bias as it is (a decode step's cache mask, every layer: on a GPU
        # each op here would be one more kernel per layer in the step's graph).
        return None if mask.bias is None else mask.bias.to(query.dtype)
    device = query.device
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device)[None, None]
    if mask.causal:
        allowed = allowed & torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
    if mask.padding is not None:
        allowed = allowed & mask.padding[:, None, None, :].to(torch.bool)
    if mask.cu_seqlens is not None:  # the batch's rows end to end: documents [batch, keys]
        tokens = torch.arange(key.shape[0] * k_len, device=device)
        document = torch.bucketize(tokens, mask.cu_seqlens[1:].to(device), right=True).view(-1, k_len)
        allowed = allowed & (document[:, -q_len:, None] == document[:, None, :])[:, None]
    additive = torch.zeros(allowed.shape, dtype=query.dtype, device=device)
    additive.masked_fill_(~allowed, torch.finfo(query.dtype).min)
    if mask.bias is not None:
        additive = additive + mask.bias.to(query.dtype)
    return additive


def norm(kind: str, hidden_size: int, eps: float) -> nn.Module:
    if kind == "RMSNorm":
        return nn.RMSNorm(hidden_size, eps=eps)
    if kind == "LayerNorm":
        return nn.LayerNorm(hidden_size, eps=eps)
    raise ValueError(f"no normalization {kind!r}; choose LayerNorm or RMSNorm")


def linear(in_features: int, out_features: int, bias: bool = True) -> nn.Module:
    return Linear(in_features, out_features, bias=bias)  # nn.Linear, gradient-accumulation fusion aware


def activation(name: str):
    functions = {
        "gelu": F.gelu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "relu": F.relu,
        "squared_relu": lambda x: F.relu(x).square(),  # Megatron's --squared-relu
        "swiglu": swiglu,
        "geglu": lambda x: F.gelu(x.chunk(2, dim=-1)[0]) * x.chunk(2, dim=-1)[1],
    }
    if name not in functions:
        raise ValueError(f"no activation {name!r}; choose one of {', '.join(functions)}")
    return functions[name]


def loss(logits: torch.Tensor, labels: torch.Tensor, tp_group=None, vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy (fp32) of ``logits`` ``[..., vocab (shard)]``, shaped like ``labels``,
    over the first ``vocab_size`` rows (the rest is padding; None: every row)."""
    if vocab_size is None:
        vocab_size = logits.shape[-1] * (tp_group.size if tp_group is not None else 1)
    return cross_entropy(logits, labels, tp_group, vocab_size)


class BlockAttention:
    """Attention over one block of keys with its log-sum-exp, and the block's share of the
    gradients given the final output and log-sum-exp (the ``block_attention`` contract).

    Plain matrix products in fp32 (or the inputs' dtype when wider): the reference that fused
    backends are compared with, and what context parallelism runs on the CPU.
    """

    takes_mask = True  # packed rows under context parallelism: each document's keys alone

    @staticmethod
    def _scores(query, key, causal: bool, softmax_scale: float, mask=None) -> torch.Tensor:
        scores = torch.matmul(query, key.transpose(-1, -2)) * softmax_scale
        if causal:
            q_len, k_len = scores.shape[-2:]
            allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
            scores = scores.masked_fill(~allowed, float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores

    @staticmethod
    def _widen(*tensors):
        dtype = torch.promote_types(tensors[0].dtype, torch.float32)
        return [t.to(dtype) for t in tensors]

    def forward(self, query, key, value, *, causal: bool, softmax_scale: float, mask=None):
        repeats = query.shape[1] // key.shape[1]
        q, k, v = self._widen(query, key.repeat_interleave(repeats, 1), value.repeat_interleave(repeats, 1))
        scores = self._scores(q, k, causal, softmax_scale, mask)
        lse = torch.logsumexp(scores, dim=-1)
        # A query that sees no key of this block (causal, keys after it) has lse -inf and output 0.
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)
        return torch.matmul(probs, v).to(query.dtype), lse

    def backward(self, grad_out, query, key, value, out, lse, *, causal: bool, softmax_scale: float, mask=None):
        repeats = query.shape[1] // key.shape[1]
        q, k, v, dout, o = self._widen(query, key.repeat_interleave(repeats, 1),
                                       value.repeat_interleave(repeats, 1), grad_out, out)
        scores = self._scores(q, k, causal, softmax_scale, mask)
        probs = torch.exp(scores - lse.to(scores.dtype).unsqueeze(-1)).nan_to_num_(0.0)
        grad_v = torch.matmul(probs.transpose(-1, -2), dout)
        grad_probs = torch.matmul(dout, v.transpose(-1, -2))
        delta = (dout * o).sum(-1, keepdim=True)
        grad_scores = probs * (grad_probs - delta) * softmax_scale
        grad_q = torch.matmul(grad_scores, k)
        grad_k = torch.matmul(grad_scores.transpose(-1, -2), q)
        if repeats > 1:  # each key/value head served ``repeats`` query heads: sum their shares
            batch, heads, seq, dim = grad_k.shape
            grad_k = grad_k.view(batch, heads // repeats, repeats, seq, dim).sum(2)
            grad_v = grad_v.view(batch, heads // repeats, repeats, seq, dim).sum(2)
        return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype)


class TorchKernels:
    name = "torch"
    kinds = frozenset({"attention", "norm", "linear", "activation", "rotary", "loss", "block_attention"})

    def is_available(self) -> tuple[bool, str]:
        return True, ""

    def component(self, kind: str):
        return {"attention": sdpa_attention, "norm": norm, "linear": linear, "activation": activation,
                "rotary": apply_rotary, "loss": loss, "block_attention": BlockAttention()}[kind]


TORCH = TorchKernels()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[seq, batch, ..., head_dim]`` by the angles of ``cos``/``sin``
    (:func:`rotary_cos_sin`, broadcasting against ``x`` without its last dimension's halving);
    the arithmetic runs in ``x``'s dtype. ``x`` may be a strided view (the query heads of the
    grouped QKV output, ``[seq, batch, groups, queries per group, head_dim]``): the result is a
    fresh contiguous tensor of ``x``'s shape, so the view costs no copy of its own."""
    # A no-op where the model handed cos/sin in x's dtype (once per forward, mega.models.blocks.rope).
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if not _records_graph(x):  # generating: the arithmetic alone, without a Function's bookkeeping
        return _rotate(x, cos, sin, inverse=False)
    return _Rotate.apply(x, cos, sin)


def _records_graph(x: torch.Tensor) -> bool:
    """Whether autograd records an op on ``x``: a custom Function's ``apply`` costs about as much
    as a small op's arithmetic on the host, which decoding pays per layer and token."""
    return torch.is_grad_enabled() and x.requires_grad


class _Rotate(torch.autograd.Function):
    """``x * cos + rotate_half(x) * sin`` without ``cat``; saves only ``cos``/``sin``.

    The textbook form negates a half and concatenates (and autograd concatenates again in the
    backward). Here one multiply writes both halves times ``cos`` into the output, and two
    in-place multiply-adds on that fresh output's halves add each half's share of the other: three
    kernels, no copy. The gradient is the inverse rotation of the incoming gradient, computed the
    same way. Nothing is written with ``out=`` (dynamo breaks its graph there, as it once did
    here); the in-place ops touch only a tensor made inside, which ``torch.compile`` traces whole.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, inverse=True), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    halves = x.unflatten(-1, (2, -1))  # [..., 2, head_dim / 2], a view of any x
    first, second = halves.unbind(-2)
    out = halves * cos.unsqueeze(-2)  # both halves times cos, into a fresh contiguous tensor
    sign = 1.0 if inverse else -1.0
    out.select(-2, 0).addcmul_(second, sin, value=sign)  # x1 cos -/+ x2 sin
    out.select(-2, 1).addcmul_(first, sin, value=-sign)  # x2 cos +/- x1 sin
    return out.flatten(-2)


def swiglu(stacked: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the stacked ``[gate; up]`` (:class:`_SwiGLU` where autograd records)."""
    return _SwiGLU.apply(stacked) if _records_graph(stacked) else _silu_times_up(stacked)


def _silu_times_up(stacked: torch.Tensor) -> torch.Tensor:
    gate, up = stacked.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of the stacked ``[gate; up]`` output.

    Autograd would keep ``gate``, ``silu(gate)`` and ``up``; this keeps only the input and
    computes both gradients from it (less memory, the same numbers). Out-of-place throughout, so
    ``torch.compile`` traces it whole and fuses it with the surrounding elementwise ops.
    """

    @staticmethod
    def forward(ctx, stacked: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(stacked)
        return _silu_times_up(stacked)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (stacked,) = ctx.saved_tensors
        gate, up = stacked.chunk(2, dim=-1)
        return torch.cat((torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)), dim=-1)
