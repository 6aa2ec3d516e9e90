"""mega's component kinds on Liger-Kernel's functions (``liger_kernel.transformers.functional``).

* ``norm``: RMSNorm (Liger's "llama" casting: the statistics in fp32, like torch's and Hugging
  Face's) and LayerNorm, holding ``weight`` (and ``bias``) as torch's norms do, so checkpoints
  do not depend on the backend.
* ``rotary``: Liger's RoPE (rotate-half, Hugging Face's layout ``[batch, heads, seq, d]`` with
  ``cos``/``sin`` ``[1 or batch, seq, d]``). Liger rotates a query and a key in one call, in
  place; mega's contract rotates one tensor, so it gets a private copy (which also lays out a
  grouped query's heads) and a one-head key. Liger's whole-``d`` cos/sin are made once per model
  forward (:class:`LigerAngles`), not per call.
* ``activation``: SwiGLU and GeGLU (Liger's GeGLU uses the tanh approximation of GELU: within
  1e-3 of the exact one torch's ``geglu`` uses); the others are torch's.
* ``linear_loss``: the fused linear cross-entropy: logits are made a chunk of tokens at a time
  and their gradients at once, so the ``[tokens, vocab]`` logits never exist whole.

Chosen per kind by measurement (one H200, docs/benchmarks.md): GPT 1.3B with Liger's LayerNorm
and fused loss ran at 0.81x torch's tokens/s, LLaMA with RMSNorm, RoPE, SwiGLU and the fused loss
at 1.05x (and 11 GB less). The loser is the kind only GPT takes, Liger's LayerNorm (its weight
gradients are reduced in a second pass over per-program partials), so ``norm`` serves RMSNorm
from Liger and LayerNorm from torch (cuDNN/ATen's fused LayerNorm).

Under ``--compile`` the calls into Liger stay out of the graph (``torch.compiler.disable``):
dynamo cannot trace Liger's Triton launchers (it failed on ``liger_rope``), and each Liger
kernel is already one fused kernel; the torch code around it is compiled.
"""

from __future__ import annotations

import importlib
import weakref

import torch
from torch import nn

from mega.core.kernels import KernelBackendError
from mega.models import torch_kernels

# Liger's (and torch's) ignore_index: tokens the loss mask drops take no part.
IGNORE_INDEX = -100


def functional():
    """``liger_kernel.transformers.functional``, looked up at call time (tests put a stand-in there)."""
    return importlib.import_module("liger_kernel.transformers.functional")


def out_of_graph(function):
    """``function`` run eagerly when a compiled graph calls it (see the module docstring)."""
    return torch.compiler.disable(function, recursive=True)


def norm(kind: str, hidden_size: int, eps: float) -> nn.Module:
    """Liger's RMSNorm; torch's LayerNorm, which measured faster (the module docstring)."""
    if kind == "LayerNorm":
        return torch_kernels.norm(kind, hidden_size, eps)
    return LigerNorm(kind, hidden_size, eps)


class LigerNorm(nn.Module):
    def __init__(self, kind: str, hidden_size: int, eps: float):
        super().__init__()
        if kind not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"no normalization {kind!r}; choose LayerNorm or RMSNorm")
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if kind == "LayerNorm" else None

    @out_of_graph
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "RMSNorm":
            # in_place=False: the backward must not overwrite the incoming gradient, which
            # recompute and pipelining may still hold.
            return functional().liger_rms_norm(x, self.weight, self.eps, in_place=False)
        return functional().liger_layer_norm(x, self.weight, self.bias, self.eps)


@out_of_graph
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[seq, batch, ..., d]`` (the grouped query's ``[s, b, groups, per group, d]``
    too) by ``cos``/``sin`` ``[seq, batch or 1, 1..., d / 2]``."""
    seq, batch, dim = x.shape[0], x.shape[1], x.shape[-1]
    # [b, s, heads, d]: always our own copy (never a view of x), which Liger rotates in place; the
    # one copy also lays out the grouped query's heads.
    query = x.transpose(0, 1).clone(memory_format=torch.contiguous_format).view(batch, seq, -1, dim)
    key = query.new_zeros(batch, seq, 1, dim)  # Liger's kernel rotates a key too
    cos, sin = LIGER_ANGLES.of(cos, sin, x.dtype)
    rotated, _ = functional().liger_rope(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    return rotated.transpose(1, 2).reshape(batch, seq, *x.shape[2:]).transpose(0, 1)  # [s, b, ..., d]


class LigerAngles:
    """Liger's ``cos``/``sin`` ``[batch or 1, seq, d]`` (both halves) from mega's ``[seq, batch or
    1, 1..., d / 2]``, made once per model forward: the model hands every layer views of the same
    two tensors (mega.models.blocks.rope), so the last ones made serve until those tensors change. Held
    by a weak reference to the model's tensors: a new forward's angles are new tensors."""

    def __init__(self):
        self._key = None
        self._angles = None

    def of(self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (_view_key(cos), _view_key(sin), dtype)
        if self._key is None or not _same_views(self._key, key):
            self._angles = tuple(_full_angles(t, dtype) for t in (cos, sin))
            self._key = tuple((weakref.ref(root), where) for root, where in key[:2]) + (dtype,)
        return self._angles


def _view_key(t: torch.Tensor):
    """The tensor ``t`` views (the model's) and where in it, ``t``'s middle ones-dimensions aside."""
    root = t._base if t._base is not None else t
    flat = t.reshape(t.shape[0], t.shape[1], t.shape[-1])  # a view: the middle dimensions are ones
    return root, (root._version, flat.storage_offset(), tuple(flat.shape), flat.stride())


def _same_views(cached, key) -> bool:
    return cached[2] == key[2] and all(ref() is root and where == was for (ref, was), (root, where)
                                       in zip(cached[:2], key[:2], strict=True))


def _full_angles(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    half = t.reshape(t.shape[0], t.shape[1], t.shape[-1])  # [s, B, d / 2]
    return torch.cat([half, half], dim=-1).transpose(0, 1).to(dtype).contiguous()  # [B, s, d]


LIGER_ANGLES = LigerAngles()


def _glu(function_name: str):
    @out_of_graph
    def glu(x: torch.Tensor) -> torch.Tensor:
        # Liger's kernels index both halves with one row stride: they must be contiguous.
        gate, up = (half.contiguous() for half in x.chunk(2, dim=-1))
        return getattr(functional(), function_name)(gate, up)

    return glu


def activation(name: str):
    if name == "swiglu":
        return _glu("liger_swiglu")
    if name == "geglu":
        return _glu("liger_geglu")
    return torch_kernels.activation(name)


class LinearCrossEntropy:
    """The ``linear_loss`` kind on ``liger_fused_linear_cross_entropy``.

    Liger's kernel needs the whole vocabulary (``vocab_parallel`` False: models refuse it under
    tensor parallelism). It weighs each token 0 or 1 (``ignore_index``); summed, not averaged,
    so the family divides by the loss mask's sum exactly as with the unfused loss.
    """

    vocab_parallel = False

    @out_of_graph
    def __call__(self, hidden, weight, labels, loss_mask, tp_group=None, vocab_size=None):
        if tp_group is not None and tp_group.size > 1:
            raise KernelBackendError("liger's fused linear cross-entropy needs the whole vocabulary on one rank "
                                     "(--tensor-model-parallel-size 1); use --linear-loss-backend torch")
        keep = loss_mask != 0
        if bool(((loss_mask != 1) & keep).any()):
            raise ValueError("liger's fused linear cross-entropy weighs every token 0 or 1, the loss mask has "
                             "other weights; use --linear-loss-backend torch")
        rows = vocab_size or weight.shape[0]  # padded vocabulary rows take no part
        return functional().liger_fused_linear_cross_entropy(
            hidden, weight[:rows], labels.masked_fill(~keep, IGNORE_INDEX), ignore_index=IGNORE_INDEX,
            reduction="sum")
