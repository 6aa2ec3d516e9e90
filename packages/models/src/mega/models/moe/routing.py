"""Top-k routing of tokens to experts: which experts, with which weights, which slots are kept,
and the router's auxiliary losses. Pure functions of the router logits (Megatron-Core's
``topk_routing_with_score_function``, ``switch_load_balancing_loss_func``, ``z_loss_func`` and
``get_capacity`` define the behaviour).

Routing always sees one micro-batch's tokens whole (the layer gathers the logits of a
sequence-parallel shard first), so dropping, capacity and the losses are the same at every layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mega.models.moe.config import MoETransformerConfig


@dataclass
class Routing:
    """``experts`` [T, k]: the chosen experts of each token; ``weights`` [T, k] (fp32): their
    weights in the output; ``kept`` [T, k] (bool): the slot is computed (False: dropped over
    capacity); ``capacity``: per-expert slots when padding to capacity, else None.
    ``aux_loss`` / ``z_loss``: scalars (zero when off); ``load`` [E]: slots routed per expert."""

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    capacity: int | None
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    load: torch.Tensor


def route(logits: torch.Tensor, config: MoETransformerConfig, sequences: int = 1,
          expert_bias: torch.Tensor | None = None, experts: torch.Tensor | None = None) -> Routing:
    """Route the tokens whose router logits are ``logits`` [T, E] (token ``t`` of sequence
    ``t % sequences``: the ``[s, b]`` order flattened); ``expert_bias`` [E]: added to the scores
    for the choice only (aux-loss-free balancing); ``experts`` [T, k]: the choice given instead
    of made (routing replay, :mod:`mega.models.moe.replay`), weighted by these logits."""
    topk, num_experts = config.moe_router_topk, config.num_experts
    weights, experts = choose_experts(logits, config, expert_bias, experts)
    scores = aux_loss_scores(logits, config)
    load = _load(experts, num_experts)
    kept, capacity = _apply_capacity(experts, weights, config)
    balancing = config.moe_router_load_balancing_type
    if balancing == "aux_loss":
        aux = switch_load_balancing_loss(scores, load, topk)
    elif balancing == "seq_aux_loss":
        per_sequence = [switch_load_balancing_loss(scores[b::sequences], _load(experts[b::sequences], num_experts), topk)
                        for b in range(sequences)]
        aux = torch.stack(per_sequence).mean()
    else:
        aux = scores.new_zeros(())
    z = z_loss(logits) if config.moe_z_loss_coeff else scores.new_zeros(())
    return Routing(experts, weights * kept, kept, capacity if config.moe_pad_expert_input_to_capacity else None,
                   aux, z, load)


def choose_experts(logits: torch.Tensor, config: MoETransformerConfig, expert_bias: torch.Tensor | None = None,
                   experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, experts [T, k]) as megatron-core's ``topk_routing_with_score_function``:
    softmax before or after the top-k, or sigmoid scores (chosen with ``expert_bias`` added,
    weighted without it, renormalised when k > 1), group-limited, times the scaling factor.
    ``experts`` given: that choice, weighted as if it had been made (the same numbers when it was)."""
    topk = config.moe_router_topk
    if config.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        choice = scores + expert_bias if expert_bias is not None else scores
        experts = top_experts(choice, config)[1] if experts is None else experts
        weights = scores.gather(1, experts)
        if topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    elif config.moe_router_pre_softmax:
        probabilities = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = (top_experts(probabilities, config) if experts is None
                            else (probabilities.gather(1, experts), experts))
    else:  # softmax over the chosen logits: Mixtral's renormalised top-k weights
        top_logits, experts = top_experts(logits, config) if experts is None else (logits.gather(1, experts), experts)
        weights = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    if config.moe_router_topk_scaling_factor:
        weights = weights * config.moe_router_topk_scaling_factor
    return weights, experts


def top_experts(scores: torch.Tensor, config: MoETransformerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k of ``scores`` [T, E]; with group-limited routing only among the
    ``--moe-router-group-topk`` groups whose best topk/group-topk scores sum highest."""
    topk, groups, group_topk = config.moe_router_topk, config.moe_router_num_groups, config.moe_router_group_topk
    if not group_topk:
        return torch.topk(scores, topk, dim=-1)
    tokens, num_experts = scores.shape
    grouped = scores.view(tokens, groups, num_experts // groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1)[0].sum(dim=-1)  # [T, groups]
    chosen_groups = torch.topk(group_scores, group_topk, dim=-1, sorted=False)[1]
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen_groups, True)
    masked = grouped.masked_fill(~allowed[..., None], float("-inf")).view(tokens, num_experts)
    return torch.topk(masked, topk, dim=-1)


def aux_loss_scores(logits: torch.Tensor, config: MoETransformerConfig) -> torch.Tensor:
    """The per-expert probabilities the load-balancing loss weighs (megatron-core's
    ``compute_routing_scores_for_aux_loss``): softmax, or sigmoids normalised per token."""
    if config.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return torch.softmax(logits, dim=-1, dtype=torch.float32)


def updated_expert_bias(expert_bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing's step (megatron-core's ``get_updated_expert_bias``): each expert's
    bias moves by ``rate`` towards an even load, by the sign of (mean load - its load); ``load``
    [E] summed over the step's micro-batches and data-parallel ranks."""
    load = load.float()
    return expert_bias + torch.sign(load.mean() - load) * rate


def _load(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Slots per expert, [num_experts]. Counted by a scatter into a fixed-size vector rather than
    ``bincount``, whose output shape depends on the data: dynamo traces this, so routing stays
    inside a compiled layer's graph."""
    return count_per_expert(experts.reshape(-1), num_experts)


def count_per_expert(flat_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of ``flat_experts`` name each of ``num_experts`` experts (int64)."""
    return flat_experts.new_zeros(num_experts).scatter_add_(0, flat_experts, torch.ones_like(flat_experts))


def switch_load_balancing_loss(scores: torch.Tensor, load: torch.Tensor, topk: int) -> torch.Tensor:
    """E * sum_e f_e * P_e, f_e = slots routed to e / (T * topk), P_e = mean probability of e."""
    tokens, num_experts = scores.shape
    return (scores.sum(0) * load.to(scores.dtype)).sum() * (num_experts / (topk * tokens * tokens))


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def expert_capacity(tokens: int, config: MoETransformerConfig) -> int:
    return math.ceil(tokens * config.moe_router_topk / config.num_experts * config.moe_expert_capacity_factor)


def _apply_capacity(experts: torch.Tensor, weights: torch.Tensor,
                    config: MoETransformerConfig) -> tuple[torch.Tensor, int | None]:
    """Keep at most ``capacity`` slots per expert, those with the highest router weights
    (Megatron's "probs" drop policy; ties go to the earlier slot)."""
    if config.moe_expert_capacity_factor is None:
        return torch.ones_like(experts, dtype=torch.bool), None
    capacity = expert_capacity(experts.shape[0], config)
    flat_experts, flat_weights = experts.reshape(-1), weights.detach().reshape(-1)
    order = torch.sort(-flat_weights, stable=True).indices
    order = order[torch.sort(flat_experts[order], stable=True).indices]  # by expert, then weight
    counts = count_per_expert(flat_experts, config.num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[flat_experts[order]]
    kept = torch.empty_like(flat_experts, dtype=torch.bool)
    kept[order] = rank_in_expert < capacity
    return kept.view_as(experts), capacity
