"""For tests only: plain-torch stand-ins for the apex modules the adapters call.

CI has neither apex nor a GPU. These implement the documented signatures: ``fused_layer_norm_affine(
input, weight, bias, normalized_shape, eps)``, ``fused_rms_norm_affine(input, weight,
normalized_shape, eps)``, ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode,
weight_decay)``, the ``scaled_upper_triang_masked_softmax_cuda`` extension's ``forward(inputs
[batches, sq, sk] fp16/bf16, scale)`` / ``backward(grads, softmax_results, scale)`` and
``scaled_masked_softmax_cuda.get_batch_per_block``. They say nothing about apex's kernels:
where apex and a GPU are present the same tests run against the real library.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F


def fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False):
    return F.layer_norm(input.float(), normalized_shape, weight.float(), bias.float(), eps).to(input.dtype)


def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    return F.rms_norm(input.float(), normalized_shape, weight.float(), eps).to(input.dtype)


class FusedAdam(torch.optim.Optimizer):
    """apex's FusedAdam as documented: Adam, with decoupled weight decay when ``adam_w_mode``;
    the step count kept per parameter group, as apex keeps it."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):
        assert not amsgrad
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            # As apex: the step count is the group's, and a parameter's state is only its moments
            # (created when the state is empty).
            group["step"] = group.get("step", 0) + 1
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad if self.adam_w_mode else param.grad + group["weight_decay"] * param
                state = self.state[param]
                if len(state) == 0:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(param), torch.zeros_like(param)
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                correction1 = 1 - beta1 ** group["step"] if group["bias_correction"] else 1.0
                correction2 = 1 - beta2 ** group["step"] if group["bias_correction"] else 1.0
                update = (state["exp_avg"] / correction1) / ((state["exp_avg_sq"] / correction2).sqrt() + group["eps"])
                if self.adam_w_mode:
                    update = update + group["weight_decay"] * param
                param.add_(update, alpha=-group["lr"])


def _causal_softmax_forward(inputs, scale):
    assert inputs.dim() == 3 and inputs.is_contiguous() and inputs.dtype in (torch.float16, torch.bfloat16)
    assert inputs.shape[1] == inputs.shape[2], "an upper-triangular mask needs as many queries as keys"
    seq = inputs.shape[-1]
    upper = torch.ones(seq, seq, dtype=torch.bool, device=inputs.device).triu(1)
    return torch.softmax((inputs.float() * float(scale)).masked_fill(upper, float("-inf")), -1).to(inputs.dtype)


def _causal_softmax_backward(output_grads, softmax_results, scale):
    grads, probs = output_grads.float(), softmax_results.float()
    return (float(scale) * probs * (grads - (grads * probs).sum(-1, keepdim=True))).to(output_grads.dtype)


def _batch_per_block(query_seq_len, key_seq_len, batches, attn_heads):
    next_power_of_two = 1 << (key_seq_len - 1).bit_length()
    warp_size = min(next_power_of_two, 32)
    batches_per_warp = 2 if next_power_of_two <= 128 else 1
    return (128 // warp_size) * batches_per_warp


def install(monkeypatch) -> dict[str, int]:
    """Put stand-ins for apex, its normalization and optimizers modules and its CUDA extensions
    into ``sys.modules`` for one test; returns a dict counting the calls of each function."""
    calls: dict[str, int] = {}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    modules = {name: types.ModuleType(name) for name in (
        "apex", "apex.normalization", "apex.normalization.fused_layer_norm", "apex.optimizers", "amp_C",
        "fused_layer_norm_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda")}
    norms = modules["apex.normalization.fused_layer_norm"]
    norms.fused_layer_norm_affine = counted("fused_layer_norm_affine", fused_layer_norm_affine)
    norms.fused_rms_norm_affine = counted("fused_rms_norm_affine", fused_rms_norm_affine)
    modules["apex.normalization"].fused_layer_norm = norms
    modules["apex"].normalization, modules["apex"].optimizers = modules["apex.normalization"], modules["apex.optimizers"]
    modules["apex.optimizers"].FusedAdam = FusedAdam
    softmax = modules["scaled_upper_triang_masked_softmax_cuda"]
    softmax.forward = counted("scaled_upper_triang_masked_softmax_forward", _causal_softmax_forward)
    softmax.backward = counted("scaled_upper_triang_masked_softmax_backward", _causal_softmax_backward)
    modules["scaled_masked_softmax_cuda"].get_batch_per_block = _batch_per_block
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return calls
