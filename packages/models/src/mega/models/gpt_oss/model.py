"""The ``gpt-oss`` stage module, its parallelization, size and FLOPs.

Parameter names are Megatron-Core's (the ``mixtral`` family's, :mod:`mega.models.mixtral.model`),
with gpt-oss's additions:

    decoder.layers.N.self_attention.linear_qkv.{weight,bias}       (biased attention)
    decoder.layers.N.self_attention.linear_proj.{weight,bias}
    decoder.layers.N.self_attention.core_attention.softmax_offset  [heads]  (the sinks)
    decoder.layers.N.mlp.router.{weight,bias}
    decoder.layers.N.mlp.experts.linear_fc1.{weight,bias}          [experts, 2 * ffn, ...]
    decoder.layers.N.mlp.experts.linear_fc2.{weight,bias}          [experts, hidden, ...]

Parallelism: tensor parallelism splits the attention as the dense plan does (the sinks with
their heads) and the experts over their tensor group (``--expert-tensor-parallel-size``: the
tensor-parallel size, or 1 under sequence parallelism: whole experts on each rank's slice; see
:mod:`mega.models.gpt_oss.experts` for the output bias); expert parallelism keeps whole experts.
"""

from __future__ import annotations

from torch import nn

from mega.core.kernels import Kernels
from mega.core.model_family import ParallelContext, Stage
from mega.core.parallel import ParallelConfig
from mega.core.parallel.param_attrs import mark_tensor_parallel
from mega.core.setup_passes import ModelSetup, Phase, per_chunk
from mega.models.blocks.layer_stack import LayerStack, PreNormLayer
from mega.models.blocks.norms import build_norm
from mega.models.config import ModelConfigError
from mega.models.flops import num_floating_point_operations as dense_flops
from mega.models.gpt_oss.attention import GptOssAttention, SinkCoreAttention, gpt_oss_cos_sin
from mega.models.gpt_oss.config import GptOssConfig
from mega.models.gpt_oss.experts import GptOssMoE, shard_gpt_oss_experts
from mega.models.initialization import init_parameter
from mega.models.mixtral.model import MoELanguageModel, moe_tensor_parallel_plan
from mega.models.parallelize import modules_of, transformer_passes


class GptOssLanguageModel(MoELanguageModel):
    def decoder_block(self, config, layers, final_norm, kernels, context):
        built = {number: PreNormLayer(build_norm(config, kernels), GptOssAttention(config, kernels, number, context),
                                      build_norm(config, kernels), GptOssMoE(config, kernels, context),
                                      config.hidden_dropout)
                 for number in layers}
        stream = context.stack_dropout_tracker if context is not None else None
        return LayerStack(built, build_norm(config, kernels) if final_norm else None, rng_stream=stream)

    def rotary_cos_sin(self):
        return gpt_oss_cos_sin


def build_gpt_oss_model(config: GptOssConfig, stage: Stage, *, kernels: Kernels, parallel: ParallelConfig,
                        context: ParallelContext | None = None) -> GptOssLanguageModel:
    config.validate_parallel(parallel)
    if parallel.expert_tp not in (1, parallel.tp):
        raise ModelConfigError(f"gpt-oss's --expert-tensor-parallel-size {parallel.expert_tp} must be 1 or the "
                               f"tensor-parallel size {parallel.tp} (the sum of the experts' output-bias gradients "
                               "runs over the tensor group)")
    if kernels.get("norm_linear") is not None:
        raise ModelConfigError("gpt-oss's layers keep their norms apart: choose a kernel backend without norm_linear")
    if config.num_moe_layers != config.num_layers or config.moe_shared_expert_intermediate_size:
        raise ModelConfigError("gpt-oss has experts in every layer and no shared expert (--moe-layer-freq 1, "
                               "no --moe-shared-expert-intermediate-size)")
    return GptOssLanguageModel(config, stage, kernels, parallel, context)


def init_gpt_oss_parameter(config: GptOssConfig, name: str):
    """Megatron's initialisation; the sinks start at zero (Megatron-Core's softmax_offset)."""
    if name.endswith("softmax_offset"):
        return lambda tensor, generator: tensor.zero_()
    return init_parameter(config, name)


def _expert_parallel(model: nn.Module, setup: ModelSetup) -> None:
    for moe in modules_of(model, GptOssMoE):
        shard_gpt_oss_experts(moe.experts, setup.groups)


def _split_sinks(model: nn.Module, setup: ModelSetup) -> None:
    """Each tensor rank keeps the sinks of its heads (the query heads' order, whole groups)."""
    tp = setup.groups.tp
    if tp.size <= 1:
        return
    for core in modules_of(model, SinkCoreAttention):
        shard = nn.Parameter(core.softmax_offset.data.chunk(tp.size)[tp.rank].clone())
        mark_tensor_parallel(shard, 0)
        core.softmax_offset = shard


GPT_OSS_PASSES = (
    per_chunk("expert-parallel", Phase.EXPERT_PARALLEL, _expert_parallel,
              "each MoE layer keeps this rank's experts and their biases (--expert-model-parallel-size)"),
    *transformer_passes(lambda model, setup: moe_tensor_parallel_plan(setup.config, model.stage),
                        amendments=(_split_sinks,)),
)


def _layer_parameters(config: GptOssConfig, experts: int) -> int:
    h, d = config.hidden_size, config.kv_channels
    qkv = (config.num_attention_heads + 2 * config.num_query_groups) * d
    attention = qkv * (h + 1) + config.num_attention_heads * d * h + h
    sinks = config.num_attention_heads if config.softmax_type == "learnable" else 0
    router = config.num_experts * (h + 1)
    ffn = config.moe_ffn_hidden_size
    expert = 2 * ffn * (h + 1) + h * (ffn + 1)
    return 2 * h + attention + sinks + router + experts * expert


def num_gpt_oss_parameters(config: GptOssConfig, tensor_parallel_size: int = 1, *, active: bool = False) -> int:
    """Parameters of the whole model, the vocabulary unpadded; ``active``: those one token
    computes with, the model card's count (its top-k experts, the output layer, not the embedding
    table it looks a row up in)."""
    experts = config.moe_router_topk if active else config.num_experts
    tables = 2 if config.untie_embeddings_and_output_weights and not active else 1
    embeddings = config.vocab_size * config.hidden_size * tables
    return embeddings + config.hidden_size + config.num_layers * _layer_parameters(config, experts)


def num_gpt_oss_floating_point_operations(config: GptOssConfig, batch_size: int, *, causal: bool = True) -> float:
    """Megatron's FLOPs with the MLP of the top-k experts a token passes through, and the router."""
    tokens = batch_size * config.seq_length
    h = config.hidden_size
    dense_mlp = (3 if config.swiglu else 2) * h * config.ffn_hidden_size
    moe = config.moe_router_topk * 3 * h * config.moe_ffn_hidden_size + h * config.num_experts
    return dense_flops(config, batch_size, causal=causal) + 3 * 2 * tokens * config.num_layers * (moe - dense_mlp)

