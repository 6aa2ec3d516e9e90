"""Optimizers over split models: fp32 main params, ZeRO-1 sharding, loss scaling, global clipping."""

from mega.core.optim.build import build_optimizer, param_groups
from mega.core.optim.clip_grads import clip_grad_norm_, global_norm, owns_gradient
from mega.core.optim.config import OptimizerConfig
from mega.core.optim.distributed_optimizer import DistributedOptimizer
from mega.core.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from mega.core.optim.optimizer import MixedPrecisionOptimizer, StepResult

__all__ = [
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "StepResult",
    "build_optimizer",
    "clip_grad_norm_",
    "global_norm",
    "owns_gradient",
    "param_groups",
]
