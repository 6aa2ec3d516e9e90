"""The ``mixtral`` stage module, its parallelization, loss, size and FLOPs.

Parameter names are Megatron-Core's, the dense ones as in :mod:`mega.models.blocks.language_model`; the
MLP of every layer is a mixture of experts:

    decoder.layers.N.mlp.router.weight                 [experts, hidden]
    decoder.layers.N.mlp.experts.linear_fc1.weight     [experts, 2 * moe_ffn_hidden, hidden]
    decoder.layers.N.mlp.experts.linear_fc2.weight     [experts, hidden, moe_ffn_hidden]

``linear_fc1.weight[e]`` is expert ``e``'s ``[gate; up]`` and ``linear_fc2.weight[e]`` its down
projection, exactly the per-expert tensors Megatron-Core names

* TEGroupedMLP: ``mlp.experts.linear_fc1.weight{e}`` / ``mlp.experts.linear_fc2.weight{e}``;
* SequentialMLP: ``mlp.experts.local_experts.{e}.linear_fc1.weight`` / ``...linear_fc2.weight``
  (``e`` the global expert index, as in its distributed checkpoints);
* GroupedMLP (legacy ``--moe-grouped-gemm``): ``mlp.experts.weight1`` ``[hidden, experts * 2F]``
  = ``linear_fc1.weight.transpose(1, 2)`` laid side by side, and ``mlp.experts.weight2``
  ``[experts * F, hidden]`` = ``linear_fc2.weight.transpose(1, 2)`` stacked.

Checkpoints hold these at global shape (all experts), so they load at any expert-parallel size.

Pipeline stages pass ``moe_stats`` [layers, 4] beside ``hidden``: each stage adds its layers'
rows (load-balancing loss, z-loss, least and most loaded expert), so the last stage's loss adds
every layer's auxiliary losses (their gradients flow back through the pipeline like the
activations') and logs them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from mega.core.kernels import CAUSAL, Kernels
from mega.core.model_family import LossContext, ParallelContext, Stage, TensorSpec, hidden_boundary
from mega.core.parallel import ParallelConfig, ParallelGroups
from mega.core.parallel.param_attrs import mark_expert_shard, mark_expert_tensor_shard, mark_tensor_parallel
from mega.core.setup_passes import ModelSetup, Phase, per_chunk
from mega.models.blocks.language_model import LanguageModel
from mega.models.config import ModelConfigError
from mega.models.family import language_model_loss
from mega.models.flops import num_floating_point_operations as dense_flops
from mega.models.moe.config import MoETransformerConfig
from mega.models.moe.layer import STATS, MoELayer
from mega.models.parallel_plan import tensor_parallel_plan
from mega.models.parallelize import modules_of, transformer_passes
from mega.models.parameter_count import num_parameters as dense_parameters

MOE_STATS = "moe_stats"


class MoELanguageModel(LanguageModel):
    def forward(self, inputs, position_ids=None, inference_cache=None, logits_to_keep=None, mask=CAUSAL):
        if not isinstance(inputs, Mapping):
            return super().forward(inputs, position_ids, inference_cache, logits_to_keep, mask)
        outputs = super().forward(inputs)
        stats = self._layer_stats(inputs[MOE_STATS].dtype if MOE_STATS in inputs else torch.float32)
        outputs[MOE_STATS] = inputs[MOE_STATS] + stats if MOE_STATS in inputs else stats
        return outputs

    def _layer_stats(self, dtype: torch.dtype) -> torch.Tensor:
        held = {int(number): layer.mlp.stats for number, layer in self.decoder.layers.items()
                if isinstance(layer.mlp, MoELayer)}  # (dense layers, --moe-layer-freq, add nothing)
        # A stage may hold no layer: the embedding's device.
        absent = torch.zeros(len(STATS), device=next(self.parameters()).device)
        return torch.stack([held.get(n, absent) for n in range(self.config.num_layers)]).to(dtype)


def build_moe_model(config: MoETransformerConfig, stage: Stage, *, kernels: Kernels,
                    parallel: ParallelConfig, context: ParallelContext | None = None) -> MoELanguageModel:
    config.validate_parallel(parallel)
    if config.num_moe_layers != config.num_layers or config.moe_shared_expert_intermediate_size:
        raise ModelConfigError("--moe-layer-freq with dense layers and --moe-shared-expert-intermediate-size are "
                               "the deepseek-v3 family's (its plan splits dense layers and shared experts); "
                               "this family has experts in every layer and no shared expert")
    return MoELanguageModel(config, stage, kernels, parallel, context)


def moe_tensor_parallel_plan(config: MoETransformerConfig, stage: Stage) -> dict:
    """The dense plan less the MLP's linear layers: experts are split by :func:`shard_experts`."""
    plan = tensor_parallel_plan(config, stage)
    for name in ("decoder.layers.*.mlp.linear_fc1", "decoder.layers.*.mlp.linear_fc2"):
        plan.pop(name, None)  # (absent on a stage that holds no layer)
    return plan


def _expert_parallel(model: nn.Module, setup: ModelSetup) -> None:
    apply_expert_parallel(model, setup.groups)


EXPERT_PARALLEL_PASS = per_chunk("expert-parallel", Phase.EXPERT_PARALLEL, _expert_parallel,
                                 "each MoE layer keeps this rank's experts (--expert-model-parallel-size)")
# The expert pass, then the dense transformer's with the plan of the layers' dense parts.
MOE_PASSES = (EXPERT_PARALLEL_PASS,
              *transformer_passes(lambda model, setup: moe_tensor_parallel_plan(setup.config, model.stage)))


def apply_expert_parallel(stage: nn.Module, groups: ParallelGroups) -> None:
    """A pass before tensor parallelism: every mixture-of-experts layer keeps this rank's experts
    (:func:`shard_experts`); it routes over the groups it was built with."""
    for moe in modules_of(stage, MoELayer):
        shard_experts(moe.experts, groups)


def shard_experts(experts: nn.Module, groups: ParallelGroups) -> None:
    """Keep this rank's experts (a block over the expert group) and, within each, its
    tensor-parallel slice over the experts' tensor group (fc1's gate and up each split on their
    own, fc2 split by input)."""
    ep, tp = groups.ep, groups.etp
    ep_rank, ep_size = max(ep.rank, 0), max(ep.size, 1)
    for linear, dim, chunks in ((experts.linear_fc1, 1, 2), (experts.linear_fc2, 2, 1)):
        weight = linear.weight.data
        per_rank = weight.shape[0] // ep_size
        weight = weight[ep_rank * per_rank:(ep_rank + 1) * per_rank]
        if tp.size > 1:
            weight = torch.cat([block.chunk(tp.size, dim)[tp.rank] for block in weight.chunk(chunks, dim)], dim)
        shard = nn.Parameter(weight.clone())
        mark_expert_shard(shard, ep_rank, ep_size)
        if tp.size > 1:
            mark_tensor_parallel(shard, dim, chunks)
            if tp is not groups.tp:
                mark_expert_tensor_shard(shard, tp.rank, tp.size)
        linear.weight = shard


def moe_boundary(config: MoETransformerConfig, stage: Stage, micro_batch_size: int, parallel: ParallelConfig,
                 dtype: torch.dtype) -> dict[str, TensorSpec]:
    return {**hidden_boundary(config, stage, micro_batch_size, parallel, dtype),
            MOE_STATS: TensorSpec((config.num_layers, len(STATS)), torch.float32)}


def moe_auxiliary_loss(stats: torch.Tensor, config: MoETransformerConfig) -> torch.Tensor:
    """Every layer's load-balancing and z-losses times their coefficients (``--moe-aux-loss-coeff``,
    ``--moe-z-loss-coeff``), of the model's ``MOE_STATS`` output ``[layers, len(STATS)]``: what a
    MoE model's training adds to whatever loss it trains on (the language model's, or GRPO's)."""
    return config.moe_aux_loss_coeff * stats[:, 0].sum() + (config.moe_z_loss_coeff or 0.0) * stats[:, 1].sum()


def moe_loss(outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor],
             context: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``lm loss`` plus every layer's load-balancing and z-losses times their coefficients;
    logs both losses (mean over layers) and the least and most loaded expert over layers."""
    loss, metrics = language_model_loss(outputs, batch, context)
    config, stats = context.config, outputs[MOE_STATS]
    total = loss + moe_auxiliary_loss(stats, config)
    detached = stats.detach()
    detached = detached[detached[:, 3] > 0]  # the MoE layers' rows (a dense layer's are zeros)
    if config.moe_router_load_balancing_type != "none":
        metrics[STATS[0]] = detached[:, 0].mean()
    if config.moe_z_loss_coeff:
        metrics[STATS[1]] = detached[:, 1].mean()
    metrics[STATS[2]] = detached[:, 2].min()
    metrics[STATS[3]] = detached[:, 3].max()
    return total, metrics


def num_moe_parameters(config: MoETransformerConfig, tensor_parallel_size: int = 1, *, active: bool = False) -> int:
    """Parameters of the whole model; ``active``: those one token uses (top-k experts' worth)."""
    h = config.hidden_size
    experts = config.moe_router_topk if active else config.num_experts
    dense_mlp = 3 * h * config.ffn_hidden_size  # what the dense count includes per layer (no biases)
    moe = h * config.num_experts + experts * 3 * h * config.moe_ffn_hidden_size
    return dense_parameters(config, tensor_parallel_size) + config.num_layers * (moe - dense_mlp)


def num_moe_floating_point_operations(config: MoETransformerConfig, batch_size: int, *, causal: bool = True) -> float:
    """Megatron's FLOPs with the MLP of the top-k experts a token passes through, and the router."""
    tokens = batch_size * config.seq_length
    h = config.hidden_size
    dense_mlp = 3 * h * config.ffn_hidden_size
    moe = config.moe_router_topk * 3 * h * config.moe_ffn_hidden_size + h * config.num_experts
    return dense_flops(config, batch_size, causal=causal) + 3 * 2 * tokens * config.num_layers * (moe - dense_mlp)
