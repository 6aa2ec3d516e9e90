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

    optimizer: str = option("adam", "registered optimizer: adam (AdamW), sgd, muon (Muon + AdamW), or a plugin's (mega plugins lists them)")
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
    # Muon (--optimizer muon; Megatron-LM's flags): hidden matrices only, AdamW (--lr, --weight-decay,
    # --adam-*) for embeddings, output layer, router, norms and biases.
    muon_momentum: float = option(0.9, "Muon momentum (EMA of the gradients)")
    muon_use_nesterov: bool = option(False, "Muon: Nesterov momentum")
    muon_num_ns_steps: int = option(5, "Muon: Newton-Schulz iterations")
    muon_coefficient_type: Literal["simple", "quintic", "polar_express"] = option(
        "quintic", "Muon: Newton-Schulz coefficients (simple: torch.optim.Muon's; quintic needs a multiple of 5 steps)")
    muon_scale_mode: Literal["spectral", "shape_scaling", "unit_rms_norm"] = option(
        "spectral", "Muon update scale: spectral sqrt(max(m,n)) (with --muon-extra-scale-factor 0.2: Moonlight's "
        "AdamW-RMS matching), shape_scaling sqrt(max(1,m/n)) (Keller Jordan's), unit_rms_norm sqrt(m/n)")
    muon_extra_scale_factor: float = option(1.0, "Muon: extra factor on the update (0.2 matches AdamW's RMS)")
    muon_fp32_matmul_prec: Literal["medium", "high", "highest"] = option(
        "medium", "Muon Newton-Schulz precision: medium iterates in bf16 (as torch.optim.Muon), high TF32, highest fp32")
    muon_split_qkv: bool = option(True, "Muon: orthogonalise fused QKV as one matrix, not as Q, K and V",
                                  flag="--muon-no-split-qkv")
    muon_split_gate_up: bool = option(True, "Muon: orthogonalise fused SwiGLU gate/up as one matrix, not two",
                                      flag="--muon-no-split-gate-up")
    qk_clip: bool = option(False, "QK-clip (Kimi K2's MuonClip) after each step: scale query/key projections down "
                           "where a head's attention logit exceeded --qk-clip-threshold")
    qk_clip_alpha: float = option(0.5, "QK-clip: the query takes eta**alpha of the factor eta, the key eta**(1-alpha)")
    qk_clip_threshold: float = option(100.0, "QK-clip: the largest attention logit allowed")
    muon_lr: float | None = option(None, "Muon's peak learning rate (default --lr; follows --lr's schedule)")
    muon_weight_decay: float | None = option(None, "Muon's weight decay (default --weight-decay)")
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
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"--muon-momentum must be in [0, 1), got {self.muon_momentum}")
        if self.muon_lr is not None and self.muon_lr <= 0:
            raise ValueError(f"--muon-lr must be > 0, got {self.muon_lr}")

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
