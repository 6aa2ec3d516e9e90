"""Build mega's optimizer for a (DDP-wrapped) model from Megatron-style settings."""

from __future__ import annotations

import torch
from torch import nn

from mega.core.distributed.ddp import DistributedDataParallel
from mega.core.optim.config import OptimizerConfig
from mega.core.optim.distributed_optimizer import DistributedOptimizer
from mega.core.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from mega.core.optim.optimizer import MixedPrecisionOptimizer
from mega.core.optim.qk_clip import QKClip
from mega.core.parallel.groups import ParallelGroups
from mega.core.plugins import Plugins, get_plugins


def param_groups(models: list[nn.Module], weight_decay: float) -> list[dict]:
    """Weights decay; biases and 1-D parameters (norms) do not, as in Megatron."""
    decay, no_decay = [], []
    for model in models:
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            (no_decay if name.endswith(".bias") or param.dim() == 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(models: list[nn.Module], groups: ParallelGroups, config: OptimizerConfig = OptimizerConfig(),
                    grad_scaler: ConstantGradScaler | DynamicGradScaler | None = None,
                    plugins: Plugins | None = None) -> MixedPrecisionOptimizer:
    """The optimizer for ``models`` (one per virtual pipeline chunk, DDP-wrapped or not).

    ``config.optimizer`` names a registered optimizer (``register_optimizers``: adam, sgd...).
    ``grad_scaler``: fp16's loss scaling (see mega.train.precision), None otherwise.
    """
    if plugins is None:
        plugins = get_plugins()
    factory = plugins.optimizers.get(config.optimizer)  # an unknown name lists the registered ones

    def make(groups_):
        return factory(groups_, config)

    options = {"clip_grad": config.clip_grad, "grad_scaler": grad_scaler}
    # A registered factory may group the parameters itself and finish once the wrapper holds the
    # main parameters: ``factory.param_groups(models, config)``, ``factory.after_build(models,
    # optimizer, groups, config)`` (mega-muon's Muon: its matrices apart from AdamW's, their layout).
    own_groups = getattr(factory, "param_groups", None)
    grouped = own_groups(models, config) if own_groups else param_groups(models, config.weight_decay)
    optimizer = _wrap(models, groups, config, make, grouped, options)
    after_build = getattr(factory, "after_build", None)
    if after_build is not None:
        after_build(models, optimizer, groups, config)
    if config.qk_clip:  # after the inner step, before the main weights go back to the model
        optimizer.qk_clip = QKClip(models, optimizer, groups, config.qk_clip_threshold, config.qk_clip_alpha)
    return optimizer


def _wrap(models, groups, config, make, grouped, options) -> MixedPrecisionOptimizer:
    sharded = [m for m in models if getattr(m, "fully_sharded", False)]  # FSDP2: the shards are the main parameters
    if sharded:
        # Start-up cost: DTensor's import takes a second; only runs that shard pay it.
        from mega.core.optim.fsdp_optimizer import FullyShardedOptimizer

        mixed_precision = any(m.compute_dtype != torch.float32 for m in sharded)
        return FullyShardedOptimizer(grouped, groups, make, mixed_precision=mixed_precision, **options)
    if not config.use_distributed_optimizer:
        return MixedPrecisionOptimizer(grouped, groups, make, **options)
    wrapped = [m for m in models if isinstance(m, DistributedDataParallel)]
    if len(wrapped) != len(models):
        raise ValueError("--use-distributed-optimizer needs every model chunk wrapped in DistributedDataParallel")
    return DistributedOptimizer(grouped, groups, make, wrapped,
                                overlap_param_gather=config.overlap_param_gather, **options)
