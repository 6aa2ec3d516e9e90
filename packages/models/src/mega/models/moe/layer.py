"""``MoELayer``: the MLP of a mixture-of-experts transformer layer (router -> dispatch -> experts
-> weighted sum), written for one device; it takes its process groups at construction (a
:class:`~mega.core.model_family.ParallelContext`, which the family's build hands down; None: one device), and the expert-parallel setup pass keeps this
rank's experts.

Tensor parallelism (experts split as dense MLPs are, see :mod:`mega.models.moe.experts`):

* the router is replicated; under sequence parallelism it scores this rank's slice of the
  sequence and the logits are gathered, so routing (top-k, capacity, losses) always sees the
  whole micro-batch, identically on every tensor rank;
* the experts' partial outputs are summed over the tensor group *before* the routing weights
  are applied, so the router's gradient is whole on every rank;
* under sequence parallelism each rank keeps its slice of the output.

``--expert-tensor-parallel-size`` (``etp``, a divisor of tp; sequence parallelism on) splits the
experts over a smaller group than the dense layers: routing still sees the whole micro-batch,
but each group of ``etp`` consecutive tensor ranks runs the experts only on the tokens of its
own sequence slices, gathered over that group (with ``etp`` 1: each rank its own slice), and
the experts' partial outputs are reduce-scattered over it. The expert-parallel dispatcher then
takes these slices from more ranks (``tp / etp`` times as many), which hold whole experts or
``1 / etp`` of each.

DeepSeek's additions (megatron-core's names): ``shared_experts`` (a SwiGLU MLP every token
passes through, :mod:`mega.models.moe.shared_experts`), and with aux-loss-free balancing
``router.expert_bias`` [E], a frozen parameter (checkpointed and converted, never trained) added
to the scores for the top-k choice; ``tokens_per_expert`` counts the slots routed since the last
optimizer step, from which :mod:`mega.models.moe.expert_bias` moves the bias after each step.

After each forward ``stats`` holds ``[load-balancing loss, z-loss, least-loaded expert,
most-loaded expert]`` (loads relative to a perfectly even spread: 1.0 each) for the family's
loss and logs.
"""

from __future__ import annotations

import torch
from torch import nn

from mega.core.kernels import Kernels
from mega.core.model_family import ParallelContext
from mega.core.parallel.collectives import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from mega.models.moe.config import MoETransformerConfig
from mega.models.moe.dispatch import dispatch
from mega.models.moe.experts import GroupedExperts
from mega.models.moe.routing import Routing, route
from mega.models.moe.shared_experts import SharedExperts

STATS = ("load_balancing_loss", "z_loss", "expert load min", "expert load max")


class MoELayer(nn.Module):
    def __init__(self, config: MoETransformerConfig, kernels: Kernels, context: ParallelContext | None = None):
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        if config.moe_router_enable_expert_bias:
            self.router.expert_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
            self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts), persistent=False)
        shared = config.moe_shared_expert_intermediate_size
        self.shared_experts = (SharedExperts(config.hidden_size, shared, kernels, gate=getattr(config, "moe_shared_expert_gate", False))
                               if shared else None)
        self.experts = GroupedExperts(config.num_experts, config.hidden_size, config.moe_ffn_hidden_size, kernels,
                                      grouped_gemm=config.moe_grouped_gemm)
        # The tensor, expert-tensor and expert groups, and whether the input is a sequence shard.
        groups = context.groups if context is not None else None
        self.tp_group = groups.tp if groups is not None else None
        self.etp_group = groups.etp if groups is not None else None  # None: the tensor group
        self.ep_group = groups.ep if groups is not None else None
        self.sequence_parallel = context is not None and context.sequence_parallel
        self.stats: torch.Tensor | None = None
        self.routing_replay = None  # set for a while by mega.models.moe.replay: records or forces the choice

    def reset_buffers(self) -> None:
        if self.config.moe_router_enable_expert_bias:
            self.tokens_per_expert.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        routed = self._routed(hidden)
        return routed if self.shared_experts is None else routed + self.shared_experts(hidden)

    def _routed(self, hidden: torch.Tensor) -> torch.Tensor:
        seq, batch, width = hidden.shape
        tokens = hidden.reshape(-1, width)
        logits = self.router(tokens)
        tp = self.tp_group
        etp = self.etp_group if self.etp_group is not None else tp
        split = tp is not None and tp.size > 1
        experts_split = etp is not None and etp.size > 1
        if split and self.sequence_parallel:
            logits = gather_from_sequence_parallel_region(logits, tp, tensor_parallel_output_grad=False)
            if experts_split:
                tokens = gather_from_sequence_parallel_region(tokens, etp, tensor_parallel_output_grad=True)
        elif split:
            tokens = copy_to_tensor_parallel_region(tokens, tp)
        expert_bias = getattr(self.router, "expert_bias", None)
        replay = self.routing_replay
        routing = route(logits, self.config, sequences=batch, expert_bias=expert_bias,
                        experts=replay.experts(logits.shape[0]) if replay is not None else None)
        if replay is not None:
            replay.chose(routing.experts)
        if expert_bias is not None and self.training and torch.is_grad_enabled():
            self.tokens_per_expert += routing.load.to(self.tokens_per_expert.dtype)
        self.stats = self._stats(routing, logits.shape[0])
        if split and self.sequence_parallel:
            # The expert tensor group's slices: this rank's and its etp - 1 neighbours' (all of tp's when etp = tp).
            mine = _rows(routing, (tp.rank // etp.size) * tokens.shape[0], tokens.shape[0])
            outputs = dispatch(tokens, mine, self.experts, self.ep_group, self.config.moe_token_dispatcher_type)
            if experts_split:
                outputs = reduce_scatter_to_sequence_parallel_region(outputs.flatten(1), etp).view(-1, *outputs.shape[1:])
            weights = routing.weights[tp.rank * outputs.shape[0]:(tp.rank + 1) * outputs.shape[0]]
        else:
            outputs = dispatch(tokens, routing, self.experts, self.ep_group, self.config.moe_token_dispatcher_type)
            if split:
                outputs = reduce_from_tensor_parallel_region(outputs, tp)
            weights = routing.weights
        combined = (outputs * weights.unsqueeze(-1).to(outputs.dtype)).sum(1)
        return combined.view(seq, batch, width)

    def _stats(self, routing, tokens: int) -> torch.Tensor:
        even = tokens * self.config.moe_router_topk / self.config.num_experts
        load = routing.load.float() / even
        return torch.stack([routing.aux_loss.float(), routing.z_loss.float(), load.min(), load.max()])


def _rows(routing: Routing, start: int, count: int) -> Routing:
    """The routing of tokens ``start`` .. ``start + count - 1`` (the losses and loads stay the
    whole micro-batch's)."""
    part = slice(start, start + count)
    return Routing(routing.experts[part], routing.weights[part], routing.kept[part], routing.capacity,
                   routing.aux_loss, routing.z_loss, routing.load)
