"""``MoETransformerConfig``: a decoder whose MLPs are mixtures of experts (Megatron's MoE flags).

The fields are Megatron's, declared once here (the ``mixtral`` family's config class), so
``--num-experts 8 --moe-router-topk 2 ...`` mean what they mean to ``pretrain_gpt.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mega.core.config.options import option, switch
from mega.models.config import ModelConfigError, TransformerConfig

LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
DISPATCHERS = ("alltoall", "allgather")


@dataclass(frozen=True)
class MoETransformerConfig(TransformerConfig):
    # Experts are SwiGLU MLPs: the default here (a redeclared field keeps its place and flag).
    swiglu: bool = option(True, "SwiGLU MLP instead of GELU (MoE experts are SwiGLU)", action=switch("--no-swiglu"))
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
    moe_router_score_function: Literal["softmax", "sigmoid"] = option(
        "softmax", "softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3: weights are the chosen experts' sigmoids, "
        "renormalised)")
    moe_router_num_groups: int | None = option(None, "split the experts into this many groups for group-limited "
                                               "routing (DeepSeek-V3's node-limited routing)")
    moe_router_group_topk: int | None = option(None, "groups each token may use, chosen by the sum of their best "
                                               "topk/group-topk scores (needs --moe-router-num-groups)")
    moe_router_topk_scaling_factor: float | None = option(None, "multiply the routing weights by this "
                                                          "(DeepSeek-V3's routed_scaling_factor)")
    moe_router_enable_expert_bias: bool = option(False, "aux-loss-free balancing: a per-expert bias added to the scores "
                                                 "for the top-k choice only, moved after every step towards an even "
                                                 "load (needs --moe-router-score-function sigmoid)")
    moe_router_bias_update_rate: float = option(1e-3, "how far each step moves an expert's bias (by the sign of "
                                                "its load's difference from the mean)")
    moe_shared_expert_intermediate_size: int | None = option(None, "hidden size of the shared experts, one SwiGLU "
                                                             "MLP every token passes through beside the routed ones "
                                                             "(DeepSeek's n_shared_experts x moe_intermediate_size)")
    moe_layer_freq: str = option("1", "which layers are MoE: every Nth (an integer), or one 0/1 per layer as "
                                 "Megatron writes it, e.g. '[0]*3+[1]*58' (the first 3 dense)")
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
        need(self.moe_router_score_function in ("softmax", "sigmoid"),
             f"--moe-router-score-function must be softmax or sigmoid, got {self.moe_router_score_function!r}")
        need(not self.moe_router_enable_expert_bias or self.moe_router_score_function == "sigmoid",
             "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        need((groups is None) == (group_topk is None),
             "group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk")
        if groups is not None:
            need(groups > 0 and experts % groups == 0,
                 f"--num-experts {experts} is not divisible by --moe-router-num-groups {groups}")
            need(0 < group_topk <= groups and topk % group_topk == 0 and topk // group_topk <= experts // groups,
                 f"--moe-router-group-topk {group_topk} must divide --moe-router-topk {topk} and be at most "
                 f"--moe-router-num-groups {groups}, each group holding topk/group-topk experts")
        shared = self.moe_shared_expert_intermediate_size
        need(shared is None or (isinstance(shared, int) and shared > 0),
             f"--moe-shared-expert-intermediate-size must be a positive integer, got {shared!r}")
        moe_layer_pattern(self.moe_layer_freq, self.num_layers)
        # (None only while __post_init__ runs: it is derived from ffn_hidden_size right after.)
        moe_ffn = self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_hidden_size
        need(isinstance(moe_ffn, int) and moe_ffn > 0, f"--moe-ffn-hidden-size must be a positive integer, got {moe_ffn!r}")

    def is_moe_layer(self, number: int) -> bool:
        """Whether layer ``number`` (0-based) has a mixture of experts (``--moe-layer-freq``)."""
        return moe_layer_pattern(self.moe_layer_freq, self.num_layers)[number]

    @property
    def num_moe_layers(self) -> int:
        return sum(moe_layer_pattern(self.moe_layer_freq, self.num_layers))

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


def moe_layer_pattern(freq, num_layers: int) -> list[bool]:
    """``--moe-layer-freq`` as one flag per layer: an integer N (layers 0, N, 2N... are MoE) or
    Megatron's list expression, sums of ``[0/1, ...]`` optionally repeated (``[0]*3+[1]*58``)."""
    text = str(freq).replace(" ", "")
    if text.lstrip("(").rstrip(")").isdigit():
        every = int(text.strip("()"))
        if every < 1:
            raise ModelConfigError(f"--moe-layer-freq must be at least 1, got {every}")
        return [n % every == 0 for n in range(num_layers)]
    pattern = []
    for term in text.strip("()").split("+"):
        items, _, repeat = term.partition("*")
        if not (items.startswith("[") and items.endswith("]")) or (repeat and not repeat.isdigit()):
            raise ModelConfigError(f"--moe-layer-freq {freq!r}: expected an integer or terms like [0]*3+[1]*58")
        values = [value for value in items[1:-1].split(",") if value]
        if any(value not in ("0", "1") for value in values):
            raise ModelConfigError(f"--moe-layer-freq {freq!r}: list entries must be 0 (dense) or 1 (MoE)")
        pattern += [value == "1" for value in values] * (int(repeat) if repeat else 1)
    if len(pattern) != num_layers:
        raise ModelConfigError(f"--moe-layer-freq {freq!r} describes {len(pattern)} layers, the model has "
                               f"--num-layers {num_layers}")
    return pattern
