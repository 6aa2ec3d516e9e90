"""``MoETransformerConfig``: a decoder whose MLPs are mixtures of experts (Megatron's MoE flags).

The fields are Megatron's, declared once here (the ``mixtral`` family's config class), so
``--num-experts 8 --moe-router-topk 2 ...`` mean what they mean to ``pretrain_gpt.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mega.core.config.options import option
from mega.models.config import ModelConfigError, TransformerConfig

LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
DISPATCHERS = ("alltoall", "allgather")


@dataclass(frozen=True)
class MoETransformerConfig(TransformerConfig):
    # Experts are SwiGLU MLPs: the default here (a redeclared field keeps its place and flag).
    swiglu: bool = option(True, "SwiGLU MLP instead of GELU (MoE experts are SwiGLU)")
    num_experts: int = option(8, "experts per MoE layer (every layer's MLP is a mixture of experts)")
    moe_ffn_hidden_size: int | None = option(None, "hidden size of each expert's MLP; default --ffn-hidden-size")
    moe_router_topk: int = option(2, "experts each token is routed to")
    moe_router_pre_softmax: bool = option(False, "softmax over all experts before the top-k (no renormalisation); "
                                          "default: softmax over the top-k logits (Mixtral's renormalised weights)")
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = option(
        "aux_loss", "aux_loss (Switch, over the micro-batch), seq_aux_loss (per sequence) or none")
    moe_aux_loss_coeff: float = option(0.0, "weight of the load-balancing loss (0: computed and logged, not trained)")
    moe_z_loss_coeff: float | None = option(None, "weight of the router z-loss (ST-MoE); default none")
    moe_expert_capacity_factor: float | None = option(
        None, "expert capacity = ceil(tokens*topk/experts * factor); the slots beyond it with the lowest "
        "router probabilities are dropped. Default: dropless")
    moe_pad_expert_input_to_capacity: bool = option(
        False, "pad every expert's input to its capacity (fixed shapes; needs --moe-expert-capacity-factor)")
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = option(
        "allgather", "how tokens reach the experts of other expert-parallel ranks (Megatron's default: "
        "allgather; its Mixtral recipes use alltoall)")
    moe_grouped_gemm: bool = option(False, "run the experts as one grouped GEMM where the device has one "
                                    "(torch._grouped_mm on a GPU); a loop over experts elsewhere, same numbers")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)

    def validate(self, tensor_parallel_size: int = 1) -> None:
        super().validate(tensor_parallel_size)
        experts, topk = self.num_experts, self.moe_router_topk

        def need(condition: bool, message: str) -> None:
            if not condition:
                raise ModelConfigError(message)

        need(isinstance(experts, int) and experts > 0, f"--num-experts must be a positive integer, got {experts!r}")
        need(isinstance(topk, int) and 0 < topk <= experts,
             f"--moe-router-topk {topk} must be between 1 and --num-experts {experts}")
        need(self.moe_router_load_balancing_type in LOAD_BALANCING,
             f"--moe-router-load-balancing-type must be one of {', '.join(LOAD_BALANCING)}, "
             f"got {self.moe_router_load_balancing_type!r}")
        need(self.moe_token_dispatcher_type in DISPATCHERS,
             f"--moe-token-dispatcher-type must be alltoall or allgather, got {self.moe_token_dispatcher_type!r}")
        need(self.moe_aux_loss_coeff >= 0, f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        need(self.moe_z_loss_coeff is None or self.moe_z_loss_coeff >= 0,
             f"--moe-z-loss-coeff must be >= 0, got {self.moe_z_loss_coeff}")
        factor = self.moe_expert_capacity_factor
        need(factor is None or factor > 0, f"--moe-expert-capacity-factor must be positive, got {factor}")
        need(not self.moe_pad_expert_input_to_capacity or factor is not None,
             "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        need(self.swiglu, "the experts are SwiGLU MLPs: MoE models need --swiglu")
        # (None only while __post_init__ runs: it is derived from ffn_hidden_size right after.)
        moe_ffn = self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_hidden_size
        need(isinstance(moe_ffn, int) and moe_ffn > 0, f"--moe-ffn-hidden-size must be a positive integer, got {moe_ffn!r}")

    def validate_parallel(self, parallel) -> None:
        """What the layout (a ``ParallelConfig``) asks of the experts: they split evenly over
        --expert-model-parallel-size, and their hidden size over --expert-tensor-parallel-size."""
        self.validate_expert_split(parallel.ep)
        etp = parallel.expert_tp
        if self.moe_ffn_hidden_size % etp:
            flag = "--expert-tensor-parallel-size" if parallel.etp is not None else "--tensor-model-parallel-size"
            raise ModelConfigError(f"--moe-ffn-hidden-size {self.moe_ffn_hidden_size} is not divisible by {flag} {etp}")

    def validate_expert_split(self, expert_parallel_size: int) -> None:
        if self.num_experts % expert_parallel_size:
            raise ModelConfigError(f"--num-experts {self.num_experts} is not divisible by "
                                   f"--expert-model-parallel-size {expert_parallel_size}")
