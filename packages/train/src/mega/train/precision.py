"""What ``--bf16`` / ``--fp16`` mean for the model's parameters and the loss scale."""

from __future__ import annotations

import torch

from mega.core.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from mega.train.config import PrecisionConfig


def model_dtype(precision: PrecisionConfig) -> torch.dtype:
    """The parameters' and activations' dtype; the optimizer keeps fp32 main weights regardless."""
    return torch.bfloat16 if precision.bf16 else torch.float16 if precision.fp16 else torch.float32


def grads_in_fp32(precision: PrecisionConfig) -> bool:
    """Whether gradients are accumulated over micro-batches and all-reduced in fp32: by default
    with bf16 (as Megatron forces), whose 8-bit mantissa would otherwise round away the smaller
    micro-batches' and ranks' contributions; fp32 trivially; fp16 only when asked (loss scaling)."""
    if precision.accumulate_allreduce_grads_in_fp32 is not None:
        return precision.accumulate_allreduce_grads_in_fp32
    return precision.bf16


def gradient_accumulation_fusion(precision: PrecisionConfig, device: torch.device) -> bool:
    """``--gradient-accumulation-fusion``; by default on a GPU with fp32 main grads (Megatron's
    default), where the weight-gradient GEMM can write fp32 from bf16 operands."""
    if precision.gradient_accumulation_fusion is not None:
        return precision.gradient_accumulation_fusion
    return device.type == "cuda" and grads_in_fp32(precision)


def grad_scaler_for(precision: PrecisionConfig) -> ConstantGradScaler | DynamicGradScaler | None:
    """fp16 needs loss scaling (static with ``--loss-scale``, else dynamic); bf16 and fp32 do not."""
    if not precision.fp16:
        return None
    if precision.loss_scale is not None:
        return ConstantGradScaler(precision.loss_scale)
    return DynamicGradScaler(
        precision.initial_loss_scale, precision.min_loss_scale,
        growth_interval=precision.loss_scale_window, hysteresis=precision.hysteresis,
    )
