"""For tests only: a plain-torch stand-in for ``liger_kernel.transformers.functional``.

CI has neither Triton nor a GPU. The stand-in implements the documented signatures and the
conventions the adapters rely on: RMSNorm's "llama" casting (fp32 statistics, cast back, then
the weight), RoPE on ``[batch, heads, seq, d]`` query *and* key rotated in place in the
``[batch, seq, heads, d]`` buffer (as Liger's kernel does) with ``cos``/``sin`` ``[1 or batch,
seq, d]``, SwiGLU/GeGLU (tanh GELU) on two contiguous halves, and the fused linear
cross-entropy with ``ignore_index`` and ``reduction``. It says nothing about Liger's kernels:
where Liger, Triton and a GPU are present the same tests run against the real library.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

from mega.core.kernel_requirements import FixedGPU
from mega.core.plugins import get_plugins
from mega.train.command import parse_run
from mega.train.launch_run import run_training


def rms_norm(X, W, eps, offset=0.0, casting_mode="llama", in_place=True):
    assert casting_mode == "llama"
    x32 = X.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(X.dtype)
    return normed * (offset + W)


def layer_norm(X, W, B, eps):
    return F.layer_norm(X.float(), X.shape[-1:], W.float(), B.float(), eps).to(X.dtype)


def _rotate(t, cos, sin, inverse):
    first, second = t.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return t * cos + rotated * (-sin if inverse else sin)


class _Rope(torch.autograd.Function):
    """Rotates the ``[b, s, h, d]`` buffers of q and k in place and returns ``[b, h, s, d]``
    views of them, as Liger's kernel does."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        buffers = [t.transpose(1, 2).contiguous() for t in (q, k)]  # [b, s, h, d]; no copy if already so
        cos_b, sin_b = cos[:, :, None, :], sin[:, :, None, :]  # [B, s, 1, d]
        for buffer in buffers:
            buffer.copy_(_rotate(buffer, cos_b, sin_b, inverse=False))
        ctx.save_for_backward(cos_b, sin_b)
        return tuple(buffer.transpose(1, 2) for buffer in buffers)

    @staticmethod
    def backward(ctx, dq, dk):
        cos_b, sin_b = ctx.saved_tensors
        grads = [_rotate(g.transpose(1, 2), cos_b, sin_b, inverse=True).transpose(1, 2) for g in (dq, dk)]
        return grads[0], grads[1], None, None


def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    assert q.dim() == 4 and k.dim() == 4 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], \
        "q [b, h, s, d] and k [b, kv_heads, s, d]"
    assert cos.dim() == 3 and cos.shape[0] in (1, q.shape[0]) and cos.shape[1:] == (q.shape[2], q.shape[3]), \
        "cos/sin [1 or batch, seq, head_dim]"
    return _Rope.apply(q, k, cos, sin)


def _glu(act):
    def glu(a, b):
        assert a.shape == b.shape and a.is_contiguous() and b.is_contiguous(), \
            "Liger's GLU kernels index a and b with one row stride"
        return act(a) * b
    return glu


def fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                               lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                               return_z_loss=False):
    assert input.dim() == 2 and weight.dim() == 2 and input.shape[1] == weight.shape[1], \
        "input [tokens, hidden], weight [vocab, hidden]"
    assert target.shape == input.shape[:1]
    logits = input @ weight.t() if bias is None else input @ weight.t() + bias
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)


def install(monkeypatch=None) -> types.ModuleType:
    """Put the stand-in into ``sys.modules`` as ``liger_kernel`` (0.5.10) and its
    ``transformers.functional`` for one test (without ``monkeypatch``: for the rest of the
    process, a spawned test rank); returns the functional module, whose ``calls`` counts the
    calls of each function."""
    calls: dict[str, int] = {}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    package = types.ModuleType("liger_kernel")
    package.__version__ = "0.5.10"
    transformers = types.ModuleType("liger_kernel.transformers")
    module = types.ModuleType("liger_kernel.transformers.functional")
    module.calls = calls
    module.liger_rms_norm = counted("liger_rms_norm", rms_norm)
    module.liger_layer_norm = counted("liger_layer_norm", layer_norm)
    module.liger_rope = counted("liger_rope", rope)
    module.liger_swiglu = counted("liger_swiglu", _glu(F.silu))
    module.liger_geglu = counted("liger_geglu", _glu(lambda a: F.gelu(a, approximate="tanh")))
    module.liger_fused_linear_cross_entropy = counted("liger_fused_linear_cross_entropy", fused_linear_cross_entropy)
    package.transformers, transformers.functional = transformers, module
    for name, value in [("liger_kernel", package), ("liger_kernel.transformers", transformers),
                        ("liger_kernel.transformers.functional", module)]:
        if monkeypatch is None:
            sys.modules[name] = value
        else:
            monkeypatch.setitem(sys.modules, name, value)
    return module


def train_on_this_rank(argv: list[str]) -> list[float]:
    """For a test's spawned rank: the stand-in installed for the process, the registered
    backend's GPU requirement bypassed, ``mega train argv`` run; its losses."""
    install()
    get_plugins().kernel_backends.get("liger").gpu = FixedGPU()
    return run_training(*parse_run(argv)).losses
