"""Megatron's fusions, torch-native: the bias of a linear layer added inside the elementwise
kernel that follows it (``--bias-gelu-fusion``, ``--bias-swiglu-fusion``,
``--bias-dropout-fusion``) and the cross-entropy computed from the logits without an fp32 copy
of them (``--cross-entropy-loss-fusion``).

Each function is written once, in plain torch, and compiled (inductor: one Triton kernel for
the forward, one for the backward, where the bias gradient's reduction is fused into the
backward's elementwise kernel) when its tensors are on a GPU. Elsewhere (the CPU: no compiler
needed at install or in CI) and inside a graph ``--compile`` is already tracing, the same
function runs as it is, so the fused and the unfused forms are one computation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _compiled_on_gpu(function: Callable) -> Callable:
    """``function``, compiled on first use with GPU tensors."""
    compiled = None

    def run(x: torch.Tensor, *args, **kwargs):
        nonlocal compiled
        if not x.is_cuda or torch.compiler.is_compiling():
            return function(x, *args, **kwargs)
        if compiled is None:
            compiled = torch.compile(function, dynamic=None)
        return compiled(x, *args, **kwargs)

    run.__name__, run.__doc__ = function.__name__, function.__doc__
    return run


@_compiled_on_gpu
def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)`` (exact, or ``approximate="tanh"``)."""
    return F.gelu(x + bias, approximate=approximate)


@_compiled_on_gpu
def bias_swiglu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x + bias`` stacked ``[gate; up]`` on the last dimension."""
    gate, up = (x + bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                     training: bool) -> torch.Tensor:
    """``residual + dropout(x + bias)``. With dropout active it runs uncompiled: the compiled
    kernel would draw other random numbers than ``nn.Dropout``, and layouts must agree."""
    if training and p > 0:
        return residual + F.dropout(x if bias is None else x + bias, p, training=True)
    return _add_bias_residual(x, bias, residual)


@_compiled_on_gpu
def _add_bias_residual(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    return residual + (x if bias is None else x + bias)


@_compiled_on_gpu
def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-token fp32 cross-entropy over the first ``vocab_size`` rows of ``logits`` ``[..., V]``
    held whole (one process's vocabulary): ``logsumexp - target logit``, the fp32 cast inside the
    reduction instead of an fp32 copy of every logit."""
    real = logits[..., :vocab_size].float()
    return torch.logsumexp(real, dim=-1) - real.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
