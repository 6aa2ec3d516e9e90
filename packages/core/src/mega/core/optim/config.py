"""The optimizer's section of a run: one declaration per flag (see mega.core.config.options)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mega.core.config import ConfigError
from mega.core.config.options import option


@dataclass(frozen=True)
class OptimizerConfig:
    """Megatron's optimizer and learning-rate flags (``adam`` is Adam with decoupled weight decay,
    i.e. AdamW, as in Megatron)."""

    optimizer: str = option("adam", "registered optimizer: adam (AdamW), sgd, or a plugin's (mega plugins lists them)")
    lr: float = option(3e-4, "peak learning rate")
    min_lr: float = option(0.0, "learning rate at the end of the decay")
    lr_decay_style: Literal["constant", "linear", "cosine"] = option("cosine", "learning-rate decay")
    lr_warmup_iters: int = option(0, "linear warm-up iterations")
    lr_decay_iters: int | None = option(None, "iterations over which to decay (default: --train-iters)")
    weight_decay: float = option(0.01, "AdamW weight decay (not applied to biases and norms)")
    adam_beta1: float = option(0.9, "Adam beta1")
    adam_beta2: float = option(0.999, "Adam beta2")
    adam_eps: float = option(1e-8, "Adam epsilon")
    sgd_momentum: float = option(0.9, "SGD momentum")
    clip_grad: float = option(1.0, "clip gradients to this global norm (0 disables)")
    use_distributed_optimizer: bool = option(False, "shard optimizer state over data-parallel ranks (ZeRO-1)")
    overlap_grad_reduce: bool = option(False, "all-reduce gradient buckets during the backward pass")
    overlap_param_gather: bool = option(False, "all-gather parameters of the distributed optimizer asynchronously")
    cpu_optimizer: bool = option(False, "keep the optimizer on the CPU (offload); not supported yet")

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr}) and --lr > 0")
        if self.lr_warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")

    def check_available(self, plugins) -> None:
        """--optimizer is registered and usable here (one that needs a library or a GPU says so, like a
        kernel backend, before any work)."""
        if self.optimizer not in plugins.optimizers:
            raise ConfigError(f"--optimizer {self.optimizer!r} is not registered; optimizers: "
                              f"{', '.join(plugins.optimizers.names())}")
        usable, missing = getattr(plugins.optimizers.get(self.optimizer), "is_available", lambda: (True, ""))()
        if not usable:
            raise ConfigError(f"--optimizer {self.optimizer} is not available: {missing}")
        if self.cpu_optimizer:
            raise ConfigError("--cpu-optimizer: optimizer offloading is not available in this version")
