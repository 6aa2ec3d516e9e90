"""Aux-loss-free balancing's update (``--moe-router-enable-expert-bias``), a training callback:
after every optimizer step each MoE layer's ``router.expert_bias`` moves by
``--moe-router-bias-update-rate`` towards an even load (:func:`~mega.models.moe.routing.updated_expert_bias`),
from the slots its experts were routed in the step's micro-batches on every data-parallel and
context-parallel rank (megatron-core sums them over that group too, in ``finalize_model_grads``).
Tensor-parallel ranks route the same whole micro-batch, so their counts are not summed again.
"""

from __future__ import annotations

import torch

from mega.core.parallel.collectives import all_reduce
from mega.models.moe.layer import MoELayer
from mega.models.moe.routing import updated_expert_bias


class ExpertBiasUpdate:
    def __init__(self, rate: float):
        self.rate = rate
        self.layers: list[MoELayer] = []
        self.group = None

    def on_stage_built(self, stage, groups) -> None:
        self.layers += [module for module in stage.modules()
                        if isinstance(module, MoELayer) and hasattr(module.router, "expert_bias")]
        self.group = groups.dp_cp

    def on_optimizer_step_end(self, run, iteration) -> None:
        if not self.layers:
            return
        loads = torch.stack([layer.tokens_per_expert for layer in self.layers])
        if self.group is not None and self.group.size > 1:
            all_reduce(loads, self.group)
        with torch.no_grad():
            for layer, load in zip(self.layers, loads, strict=True):
                bias = layer.router.expert_bias
                bias.copy_(updated_expert_bias(bias, load, self.rate))
                layer.tokens_per_expert.zero_()


def expert_bias_update(run_config) -> ExpertBiasUpdate | None:
    """The callback for runs whose model moves an expert bias (None otherwise)."""
    model = run_config.model
    if not getattr(model, "moe_router_enable_expert_bias", False):
        return None
    return ExpertBiasUpdate(model.moe_router_bias_update_rate)
