"""The ``deepseek-v3`` family: multi-latent attention (:mod:`mega.models.blocks.mla`) with YaRN RoPE,
the first layers dense and the rest mixtures of experts with shared experts, sigmoid routing
over expert groups, aux-loss-free balancing (an expert bias moved after every step,
:mod:`mega.models.moe.expert_bias`) and multi-token prediction (:mod:`mega.models.deepseek_v3.mtp`).

Parameter names are megatron-core's (``MLASelfAttention``, ``SharedExpertMLP``, ``TopKRouter``,
``MultiTokenPredictionBlock``), beside the dense and MoE ones of :mod:`mega.models.mixtral.model`:

    decoder.layers.N.self_attention.linear_q_down_proj.weight    [q_lora_rank, h]
    decoder.layers.N.self_attention.q_layernorm.weight           [q_lora_rank]
    decoder.layers.N.self_attention.linear_q_up_proj.weight      [heads * (nope + rope), q_lora_rank]
      (or linear_q_proj.weight [heads * (nope + rope), h] without --q-lora-rank)
    decoder.layers.N.self_attention.linear_kv_down_proj.weight   [kv_lora_rank + rope, h]
    decoder.layers.N.self_attention.kv_layernorm.weight          [kv_lora_rank]
    decoder.layers.N.self_attention.linear_kv_up_proj.weight     [heads * (nope + v), kv_lora_rank]
    decoder.layers.N.self_attention.linear_proj.weight           [h, heads * v]
    decoder.layers.N.mlp.router.expert_bias                      [experts] (frozen)
    decoder.layers.N.mlp.shared_experts.linear_fc{1,2}.weight

Presets: DeepSeek-V3 (671B, 37B active: 61 layers, the first 3 dense, hidden 7168, 128 heads,
q/kv ranks 1536/512, 256 experts of 2048 top-8 in 8 groups of which 4, one shared expert, routed
weights x2.5, YaRN x40 over 4096, one MTP module) and DeepSeek-V2-Lite's shape with V3's routing
(``v2-lite``: 27 layers, hidden 2048, 64 experts top-6, no query bottleneck); ``tiny`` for tests.
"""

from __future__ import annotations

from mega.core.model_family import ModelFamily, Stage
from mega.core.parallel.plan import Colwise, PlanStyle, Rowwise, SequenceParallelOutput, VocabEmbedding
from mega.models.deepseek_v3.config import DeepSeekV3Config
from mega.models.deepseek_v3.hf_deepseek_v3 import DEEPSEEK_V3
from mega.models.deepseek_v3.model import build_deepseek_model, deepseek_loss, deepseek_stages
from mega.models.initialization import init_parameter
from mega.models.mixtral.memory import moe_stage_footprint
from mega.models.mixtral.model import EXPERT_PARALLEL_PASS, moe_boundary
from mega.models.parallel_plan import tensor_parallel_plan
from mega.models.parallelize import transformer_passes


def deepseek_config(num_layers: int, dense_layers: int, hidden_size: int, num_attention_heads: int,
                    num_experts: int, moe_ffn_hidden_size: int, **overrides) -> DeepSeekV3Config:
    settings = dict(
        num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=18432, num_attention_heads=num_attention_heads,
        num_experts=num_experts, moe_ffn_hidden_size=moe_ffn_hidden_size, moe_router_topk=8,
        moe_layer_freq=f"[0]*{dense_layers}+[1]*{num_layers - dense_layers}",
        moe_shared_expert_intermediate_size=moe_ffn_hidden_size, moe_router_score_function="sigmoid",
        moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5,
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
        q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
        rope_type="yarn", rotary_scaling_factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
        mscale_all_dim=1.0, mtp_num_layers=1, mtp_loss_scaling_factor=0.1,
        seq_length=4096, max_position_embeddings=163840, vocab_size=129280, rotary_base=10000.0,
        position_embedding_type="rope", normalization="RMSNorm", layernorm_epsilon=1e-6, swiglu=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.006,
    )
    settings.update(overrides)
    return DeepSeekV3Config(**settings)


PRESETS = {
    "tiny": deepseek_config(2, 1, 64, 4, 8, 32, ffn_hidden_size=96, moe_router_topk=4, moe_router_num_groups=4,
                            moe_router_group_topk=2, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16,
                            qk_pos_emb_head_dim=8, v_head_dim=16, rotary_scaling_factor=4.0,
                            original_max_position_embeddings=64, seq_length=128, max_position_embeddings=256,
                            vocab_size=32000, init_method_std=0.02),
    "v3": deepseek_config(61, 3, 7168, 128, 256, 2048),
    "v2-lite": deepseek_config(27, 1, 2048, 16, 64, 1408, ffn_hidden_size=10944, moe_router_topk=6,
                               moe_router_num_groups=1, moe_router_group_topk=1, q_lora_rank=None,
                               moe_shared_expert_intermediate_size=2 * 1408, moe_router_topk_scaling_factor=1.0,
                               max_position_embeddings=163840, vocab_size=102400, mtp_num_layers=None),
}


def deepseek_init_parameter(config: DeepSeekV3Config, name: str):
    """Megatron's scheme; the expert bias starts at zero."""
    if name.endswith("router.expert_bias"):
        return lambda tensor, generator: tensor.zero_()
    return init_parameter(config, name)


def deepseek_tensor_parallel_plan(config: DeepSeekV3Config, stage: Stage) -> dict[str, PlanStyle]:
    """The dense plan without QKV and the MLP's layers, then layer by layer: MLA's up projections
    column-parallel (whole heads), the dense layers' and shared experts' MLPs as dense MLPs.
    Routed experts are split by :func:`mega.models.mixtral.model.shard_experts`."""
    plan = tensor_parallel_plan(config, stage)
    for name in ("decoder.layers.*.self_attention.linear_qkv", "decoder.layers.*.mlp.linear_fc1",
                 "decoder.layers.*.mlp.linear_fc2"):
        plan.pop(name)
    query = "linear_q_up_proj" if config.q_lora_rank is not None else "linear_q_proj"
    plan[f"decoder.layers.*.self_attention.{query}"] = Colwise()
    plan["decoder.layers.*.self_attention.linear_kv_up_proj"] = Colwise()
    for n in stage.layers["decoder"]:
        mlp = f"decoder.layers.{n}.mlp." if not config.is_moe_layer(n) else (
            f"decoder.layers.{n}.mlp.shared_experts." if config.moe_shared_expert_intermediate_size else None)
        if mlp is not None:
            plan[mlp + "linear_fc1"] = Colwise(chunks=2)
            plan[mlp + "linear_fc2"] = Rowwise()
    if config.mtp_num_layers and stage.is_last:
        plan["embedding"] = SequenceParallelOutput()  # the MTP modules embed tokens on this stage
        plan["embedding.word_embeddings"] = VocabEmbedding()
        prefix = "mtp.layers.*.transformer_layer."
        plan[f"{prefix}self_attention.{query}"] = Colwise()
        plan[f"{prefix}self_attention.linear_kv_up_proj"] = Colwise()
        plan[f"{prefix}self_attention.linear_proj"] = Rowwise()
        mlp = f"{prefix}mlp." if not config.is_moe_layer(config.num_layers - 1) else (
            f"{prefix}mlp.shared_experts." if config.moe_shared_expert_intermediate_size else None)
        if mlp is not None:
            plan[mlp + "linear_fc1"] = Colwise(chunks=2)
            plan[mlp + "linear_fc2"] = Rowwise()
    return plan


DEEPSEEK_PASSES = (
    EXPERT_PARALLEL_PASS,
    *transformer_passes(lambda model, setup: deepseek_tensor_parallel_plan(setup.config, model.stage)),
)


def num_deepseek_parameters(config: DeepSeekV3Config, tensor_parallel_size: int = 1, *, active: bool = False) -> int:
    """Parameters of the whole model (the expert biases are not trained: not counted); ``active``:
    those one token uses. MTP modules included."""
    h, heads = config.hidden_size, config.num_attention_heads
    nope, rope, v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
    if config.q_lora_rank is None:
        query = h * heads * (nope + rope)
    else:
        query = h * config.q_lora_rank + config.q_lora_rank + config.q_lora_rank * heads * (nope + rope)
    attention = (query + h * (config.kv_lora_rank + rope) + config.kv_lora_rank
                 + config.kv_lora_rank * heads * (nope + v) + heads * v * h)
    experts = config.moe_router_topk if active else config.num_experts
    moe = h * config.num_experts + experts * 3 * h * config.moe_ffn_hidden_size
    moe += 3 * h * (config.moe_shared_expert_intermediate_size or 0)
    dense = 3 * h * config.ffn_hidden_size
    layer_norms = 2 * h
    layers = (config.num_layers * (attention + layer_norms) + config.num_moe_layers * moe
              + (config.num_layers - config.num_moe_layers) * dense)
    vocab = config.padded_vocab_size(tensor_parallel_size) * h
    mtp = (config.mtp_num_layers or 0) * (attention + layer_norms + moe + 3 * h + 2 * h * h)
    return vocab * 2 + layers + h + mtp


def num_deepseek_floating_point_operations(config: DeepSeekV3Config, batch_size: int, *, causal: bool = True) -> float:
    """Megatron's count (``num_floating_point_operations`` with ``multi_latent_attention``): every
    matmul's weights at 2 FLOPs each, the top-k and shared experts only, the attention scores over
    (nope + rope) and their product with V over v channels (causal: half), the output layer, and
    each MTP module as one more MoE layer plus its projection and its own output layer; backward
    twice the forward."""
    tokens, s, h, heads = batch_size * config.seq_length, config.seq_length, config.hidden_size, config.num_attention_heads
    nope, rope, v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
    if config.q_lora_rank is None:
        query = h * heads * (nope + rope)
    else:
        query = config.q_lora_rank * (h + heads * (nope + rope) + 1)  # down, up, and the latent's norm
    projections = (query + config.kv_lora_rank * (h + heads * (nope + v) + 1) + h * rope  # as query; the rope key
                   + heads * v * h)
    scores = s * heads * (nope + rope + v) * (0.5 if causal else 1.0)
    attention = projections + scores
    moe = (config.moe_router_topk * config.moe_ffn_hidden_size + (config.moe_shared_expert_intermediate_size or 0)) * 3 * h
    moe += h * config.num_experts
    dense = 3 * h * config.ffn_hidden_size
    per_token = (config.num_layers * attention + config.num_moe_layers * moe
                 + (config.num_layers - config.num_moe_layers) * dense + h * config.vocab_size)
    per_token += (config.mtp_num_layers or 0) * (attention + moe + 2 * h * h + h * config.vocab_size)
    return float(3 * 2 * tokens * per_token)


FAMILY = ModelFamily(
    name="deepseek-v3",
    config_class=DeepSeekV3Config,
    presets=PRESETS,
    build=build_deepseek_model,
    init_parameter=deepseek_init_parameter,
    loss=deepseek_loss,
    pipeline_stages=deepseek_stages,
    num_parameters=num_deepseek_parameters,
    num_floating_point_operations=num_deepseek_floating_point_operations,
    tensor_parallel_plan=deepseek_tensor_parallel_plan,
    setup_passes=DEEPSEEK_PASSES,
    boundary=moe_boundary,
    features=frozenset({"moe", "context_parallel"}),
    memory_model=moe_stage_footprint,
    description="DeepSeek-V3: multi-latent attention, shared + routed experts with sigmoid group routing, "
                "aux-loss-free balancing, multi-token prediction",
    hf_mapping=DEEPSEEK_V3,
)
