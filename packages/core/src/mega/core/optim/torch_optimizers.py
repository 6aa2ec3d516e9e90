"""The optimizers mega-core registers (``--optimizer adam|sgd``); plugins register more."""

from __future__ import annotations

import torch

from mega.core.optim.config import OptimizerConfig


def adam(param_groups: list[dict], config: OptimizerConfig) -> torch.optim.Optimizer:
    """Megatron's ``adam``: Adam with decoupled weight decay. One fused kernel for all tensors on
    CUDA; foreach (one dispatch per step for all tensors) elsewhere, faster on CPUs too."""
    on_cuda = any(p.is_cuda for group in param_groups for p in group["params"])
    return torch.optim.AdamW(param_groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                             eps=config.adam_eps, weight_decay=config.weight_decay,
                             fused=True if on_cuda else None, foreach=None if on_cuda else True)


def sgd(param_groups: list[dict], config: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(param_groups, lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay)
