"""The ``qwen3-next`` stage module: the MoE decoder of :mod:`mega.models.mixtral.model` whose layers
are Gated DeltaNet linear attention (:mod:`.gated_delta_net`) or gated full attention
(:mod:`.gated_attention`) by ``--linear-attention-freq``, every norm zero-centred
(:mod:`.norms`), every MLP a mixture of experts with a gated shared expert; its tensor plan,
setup passes and sizes.

Parameter names beside the MoE ones (``decoder.layers.N.mlp.router/experts/shared_experts``):

    decoder.layers.N.input_layernorm.weight, pre_mlp_layernorm.weight      (zero-centred)
    full attention:  decoder.layers.N.self_attention.{linear_qkv, q_layernorm, k_layernorm, linear_proj}
    linear:          decoder.layers.N.self_attention.{in_proj_qkvz, in_proj_ba, conv1d, A_log, dt_bias,
                                                      out_norm, out_proj}
    decoder.layers.N.mlp.shared_experts.gate_weight                        [1, hidden]

Tensor parallelism splits the heads of both kinds: the full attention's query groups (with their
gates) as Megatron's QKV, the linear layers' key heads with their value heads (projections,
convolution channels, decays); the norms that see only a rank's heads sum their gradients.
Context parallelism is refused: the linear layers' recurrence runs along the whole sequence.
"""

from __future__ import annotations

from torch import nn

from mega.core.kernels import Kernels
from mega.core.model_family import ParallelContext, Stage
from mega.core.parallel import ParallelConfig, ParallelGroups
from mega.core.parallel.param_attrs import mark_sequence_parallel, mark_tensor_parallel
from mega.core.parallel.plan import Colwise, PlanStyle, Rowwise, SequenceParallelOutput, VocabEmbedding
from mega.core.setup_passes import ModelSetup
from mega.models.blocks.layer_stack import LayerStack, PreNormLayer
from mega.models.config import ModelConfigError
from mega.models.deepseek_v3.model import DeepSeekModel
from mega.models.deepseek_v3.mtp import MultiTokenPrediction
from mega.models.mixtral.model import EXPERT_PARALLEL_PASS
from mega.models.moe.layer import MoELayer
from mega.models.parallel_plan import tensor_parallel_plan
from mega.models.parallelize import modules_of, transformer_passes
from mega.models.qwen3_next.config import HybridLinearAttentionConfig
from mega.models.qwen3_next.gated_attention import GatedSelfAttention, partial_rotary_cos_sin
from mega.models.qwen3_next.gated_delta_net import GatedDeltaNet
from mega.models.qwen3_next.norms import ZeroCenteredRMSNorm


def hybrid_layer(config: HybridLinearAttentionConfig, kernels: Kernels, number: int,
                 context: ParallelContext | None = None) -> PreNormLayer:
    """Layer ``number``: linear or full attention, then the experts, each after a zero-centred norm."""
    mixer = GatedDeltaNet(config, kernels) if config.is_linear_layer(number) else GatedSelfAttention(
        config, kernels, context)
    return PreNormLayer(ZeroCenteredRMSNorm(config.hidden_size, config.layernorm_epsilon), mixer,
                        ZeroCenteredRMSNorm(config.hidden_size, config.layernorm_epsilon),
                        MoELayer(config, kernels, context), config.hidden_dropout)


class HybridLanguageModel(DeepSeekModel):
    """The MoE decoder of hybrid layers; with ``--mtp-num-layers`` DeepSeek-V3's multi-token
    prediction on the last stage, its norms zero-centred and its layer a full-attention one."""

    def decoder_block(self, config, layers, final_norm, kernels, context):
        stack = {number: hybrid_layer(config, kernels, number, context) for number in layers}
        norm = ZeroCenteredRMSNorm(config.hidden_size, config.layernorm_epsilon) if final_norm else None
        return LayerStack(stack, norm, rng_stream=context.stack_dropout_tracker if context is not None else None)

    def rotary_cos_sin(self):
        return partial_rotary_cos_sin

    def build_mtp(self, config, kernels, context) -> MultiTokenPrediction:
        full_attention = config.linear_attention_freq - 1  # a full-attention layer's number
        return MultiTokenPrediction(config, kernels, context,
                                    norm=lambda: ZeroCenteredRMSNorm(config.hidden_size, config.layernorm_epsilon),
                                    layer=lambda: hybrid_layer(config, kernels, full_attention, context))

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers whose generation state is recurrent (a fixed size per sequence), not keys
        and values: the engine keeps a state cache for them (mega.inference's recurrent cache)."""
        return tuple(int(n) for n, layer in self.decoder.layers.items()
                     if isinstance(layer.self_attention, GatedDeltaNet))


def build_hybrid_model(config: HybridLinearAttentionConfig, stage: Stage, *, kernels: Kernels,
                       parallel: ParallelConfig, context: ParallelContext | None = None) -> HybridLanguageModel:
    config.validate_parallel(parallel)
    if parallel.cp > 1:
        raise ModelConfigError(f"--context-parallel-size {parallel.cp}: qwen3-next's Gated DeltaNet linear-attention "
                               "layers run their recurrence along the whole sequence, which mega does not split "
                               "across ranks; use --context-parallel-size 1")
    if not config.moe_shared_expert_intermediate_size or config.num_moe_layers != config.num_layers:
        raise ModelConfigError("the qwen3-next family has experts in every layer (--moe-layer-freq 1) and a shared "
                               "expert (--moe-shared-expert-intermediate-size)")
    return HybridLanguageModel(config, stage, kernels, parallel, context)


def hybrid_tensor_parallel_plan(config: HybridLinearAttentionConfig, stage: Stage) -> dict[str, PlanStyle]:
    """Layer by layer: the full attention's QKV (whole query groups with their gates) and the
    linear layers' projections (whole key heads) column-parallel, their outputs row-parallel, the
    shared experts as dense MLPs; routed experts are split by the expert pass."""
    plan = {name: style for name, style in tensor_parallel_plan(config, stage).items()
            if not name.startswith("decoder.layers.")}
    layers = [(f"decoder.layers.{n}.", config.is_linear_layer(n)) for n in stage.layers["decoder"]]
    if config.mtp_num_layers and stage.is_last:
        plan["embedding"] = SequenceParallelOutput()  # the MTP modules embed tokens on this stage
        plan["embedding.word_embeddings"] = VocabEmbedding()
        layers += [(f"mtp.layers.{k}.transformer_layer.", False) for k in range(config.mtp_num_layers)]
    for prefix, linear in layers:
        if linear:
            plan[prefix + "self_attention.in_proj_qkvz"] = Colwise()
            plan[prefix + "self_attention.in_proj_ba"] = Colwise()
            plan[prefix + "self_attention.out_proj"] = Rowwise()
        else:
            plan[prefix + "self_attention.linear_qkv"] = Colwise()
            plan[prefix + "self_attention.linear_proj"] = Rowwise()
        plan[prefix + "mlp.shared_experts.linear_fc1"] = Colwise(chunks=2)
        plan[prefix + "mlp.shared_experts.linear_fc2"] = Rowwise()
    return plan


def split_head_parameters(stage: nn.Module, setup: ModelSetup) -> None:
    """After the plan: each linear layer keeps its key heads' convolution channels and its value
    heads' decays (contiguous blocks: every layout is grouped by key head), and the norms that
    see only this rank's heads sum their gradients over the tensor group."""
    apply_head_split(stage, setup.groups)


def apply_head_split(stage: nn.Module, groups: ParallelGroups) -> None:
    tp = groups.tp
    if tp.size <= 1:
        return
    for layer in modules_of(stage, GatedDeltaNet):
        for owner, name in ((layer.conv1d, "weight"), (layer, "A_log"), (layer, "dt_bias")):
            shard = nn.Parameter(getattr(owner, name).data.chunk(tp.size, 0)[tp.rank].clone())
            mark_tensor_parallel(shard, 0)
            setattr(owner, name, shard)
        for param in layer.out_norm.parameters():
            mark_sequence_parallel(param)
    for attention in modules_of(stage, GatedSelfAttention):
        for param in (*attention.q_layernorm.parameters(), *attention.k_layernorm.parameters()):
            mark_sequence_parallel(param)


HYBRID_PASSES = (EXPERT_PARALLEL_PASS,
                 *transformer_passes(lambda model, setup: hybrid_tensor_parallel_plan(setup.config, model.stage),
                                     amendments=(split_head_parameters,)))


def mixer_parameters(config: HybridLinearAttentionConfig, tensor_parallel_size: int = 1) -> tuple[int, int]:
    """Parameters one tensor-parallel rank holds of one linear-attention and of one full-attention
    mixer (the norms that see a rank's heads whole on every rank)."""
    h, tp = config.hidden_size, tensor_parallel_size
    keys, values = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    key_dim, value_dim = keys * dk, values * dv
    linear = (h * (2 * key_dim + 2 * value_dim) + h * 2 * values + (2 * key_dim + value_dim) * config.linear_conv_kernel_dim
              + 2 * values + value_dim * h) // tp + dv
    full = (h * (2 * config.query_projection_size + 2 * config.kv_projection_size)
            + config.query_projection_size * h) // tp + 2 * config.kv_channels
    return linear, full


def num_hybrid_parameters(config: HybridLinearAttentionConfig, tensor_parallel_size: int = 1, *,
                          active: bool = False) -> int:
    """Parameters of the whole model; ``active``: those one token uses (its top-k experts, the
    shared expert and everything else)."""
    h = config.hidden_size
    linear, full = mixer_parameters(config)
    experts = config.moe_router_topk if active else config.num_experts
    moe = h * config.num_experts + experts * 3 * h * config.moe_ffn_hidden_size
    moe += 3 * h * config.moe_shared_expert_intermediate_size + (h if config.moe_shared_expert_gate else 0)
    linear_layers = config.num_linear_layers
    layers = (linear_layers * linear + (config.num_layers - linear_layers) * full
              + config.num_layers * (moe + 2 * h))
    mtp = (config.mtp_num_layers or 0) * (full + moe + 2 * h + 3 * h + 2 * h * h)  # the layer, norms, eh_proj
    vocab = config.padded_vocab_size(tensor_parallel_size) * h
    return vocab * (2 if config.untie_embeddings_and_output_weights else 1) + layers + h + mtp


def num_hybrid_floating_point_operations(config: HybridLinearAttentionConfig, batch_size: int, *,
                                         causal: bool = True) -> float:
    """Every matmul's weights at 2 FLOPs per token (top-k and shared experts only), full attention's
    scores and values (causal: half), the delta rule's state reads and writes (about 4 dk dv per
    value head and token) and the output layer; backward twice the forward."""
    tokens, s, h = batch_size * config.seq_length, config.seq_length, config.hidden_size
    linear, full = mixer_parameters(config)
    scores = 2 * s * config.num_attention_heads * config.kv_channels * (0.5 if causal else 1.0)
    recurrence = 4 * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    moe = (config.moe_router_topk * config.moe_ffn_hidden_size + config.moe_shared_expert_intermediate_size) * 3 * h
    moe += h * config.num_experts
    linear_layers = config.num_linear_layers
    per_token = (linear_layers * (linear + recurrence) + (config.num_layers - linear_layers) * (full + scores)
                 + config.num_layers * moe + h * config.vocab_size)
    per_token += (config.mtp_num_layers or 0) * (full + scores + moe + 2 * h * h + h * config.vocab_size)
    return float(3 * 2 * tokens * per_token)
