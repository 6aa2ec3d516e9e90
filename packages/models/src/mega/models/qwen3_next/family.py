"""The ``qwen3-next`` family: Qwen3-Next's hybrid decoder (:mod:`mega.models.qwen3_next.model`):
three Gated DeltaNet linear-attention layers to one gated full-attention layer, zero-centred
RMSNorms, RoPE on a quarter of each head, and in every layer a top-k mixture of SwiGLU experts
beside a shared expert scaled by a sigmoid gate.

Presets: Qwen3-Next-80B-A3B (its Hugging Face config: 48 layers, hidden 2048; full attention 16
heads of 256 over 2 key/value heads, RoPE theta 10^7 on 64 of 256 channels; linear attention 16
key heads of 128 and 32 value heads of 128, convolution width 4; 512 experts of 512, top-10, a
shared expert of 512; vocabulary 151936, untied; 262144 positions; one multi-token-prediction
module). Its size by :func:`~mega.models.qwen3_next.model.num_hybrid_parameters`: without the MTP
module (what transformers loads, and the model card counts) 79,674,391,296 parameters and
3,874,929,408 active per token; the model card says 80B and 3B activated, its "3B" leaving out the
word embedding and the output layer (2 x 311,164,928): 3,252,599,552. The MTP module adds
1,650,471,424 (71,315,968 active). ``tiny``: four layers (linear, full, linear, full) and one MTP
module, for tests and demos.

Multi-token prediction (``--mtp-num-layers``): DeepSeek-V3's modules on the last pipeline stage
(:mod:`mega.models.deepseek_v3.mtp`: its loss, its pipeline stages that hand the last stage the
tokens), each with zero-centred norms and a full-attention layer of this family. The released
checkpoints' ``mtp.*`` tensors, which transformers' class does not load, convert to and from them
(:mod:`mega.models.qwen3_next.hf_qwen3_next`).
"""

from __future__ import annotations

from mega.core.model_family import ModelFamily
from mega.models.deepseek_v3.model import deepseek_loss, deepseek_stages
from mega.models.initialization import init_parameter
from mega.models.mixtral.model import moe_boundary
from mega.models.qwen3_next.config import HybridLinearAttentionConfig, Qwen3NextConfig
from mega.models.qwen3_next.hf_qwen3_next import QWEN3_NEXT
from mega.models.qwen3_next.memory import hybrid_stage_footprint
from mega.models.qwen3_next.model import (
    HYBRID_PASSES,
    build_hybrid_model,
    hybrid_tensor_parallel_plan,
    num_hybrid_floating_point_operations,
    num_hybrid_parameters,
)

ZERO_CENTRED_NORMS = ("input_layernorm.weight", "pre_mlp_layernorm.weight", "final_layernorm.weight",
                      "q_layernorm.weight", "k_layernorm.weight", "enorm.weight", "hnorm.weight")


def qwen3_next_config(num_layers: int, hidden_size: int, num_experts: int, **overrides) -> HybridLinearAttentionConfig:
    settings = dict(
        num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=5120, num_attention_heads=16,
        num_query_groups=2, kv_channels=256, num_experts=num_experts, moe_ffn_hidden_size=512, moe_router_topk=10,
        moe_shared_expert_intermediate_size=512, moe_shared_expert_gate=True, linear_attention_freq=4,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, rotary_percent=0.25, rotary_base=1e7, seq_length=4096,
        max_position_embeddings=262144, vocab_size=151936, position_embedding_type="rope", normalization="RMSNorm",
        layernorm_epsilon=1e-6, swiglu=True, qk_layernorm=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        moe_aux_loss_coeff=0.001, mtp_num_layers=1,
    )
    settings.update(overrides)
    return Qwen3NextConfig(**settings)


PRESETS = {
    "tiny": qwen3_next_config(4, 64, 4, ffn_hidden_size=96, num_attention_heads=4, kv_channels=16,
                              moe_ffn_hidden_size=32, moe_router_topk=2, moe_shared_expert_intermediate_size=48,
                              linear_attention_freq=2, linear_key_head_dim=8, linear_value_head_dim=12,
                              linear_num_key_heads=2, linear_num_value_heads=4, rotary_percent=0.5, seq_length=128,
                              max_position_embeddings=128, vocab_size=512),
    "80b-a3b": qwen3_next_config(48, 2048, 512),
}


def qwen3_next_init_parameter(config: HybridLinearAttentionConfig, name: str):
    """Megatron's scheme, with the zero-centred norms at 0 (a scale of 1), the decays' ``A_log``
    at log(uniform(1, 16)) and ``dt_bias`` at 1 (transformers' start)."""
    if name.endswith(ZERO_CENTRED_NORMS):
        return lambda tensor, generator: tensor.zero_()
    if name.endswith(".A_log"):
        return lambda tensor, generator: tensor.uniform_(1.0, 16.0, generator=generator).log_()
    if name.endswith(".dt_bias"):
        return lambda tensor, generator: tensor.fill_(1.0)
    return init_parameter(config, name)


FAMILY = ModelFamily(
    name="qwen3-next",
    config_class=Qwen3NextConfig,
    presets=PRESETS,
    build=build_hybrid_model,
    init_parameter=qwen3_next_init_parameter,
    loss=deepseek_loss,
    pipeline_stages=deepseek_stages,
    num_parameters=num_hybrid_parameters,
    num_floating_point_operations=num_hybrid_floating_point_operations,
    tensor_parallel_plan=hybrid_tensor_parallel_plan,
    setup_passes=HYBRID_PASSES,
    boundary=moe_boundary,
    features=frozenset({"moe"}),
    memory_model=hybrid_stage_footprint,
    description="Qwen3-Next: Gated DeltaNet linear attention 3:1 with gated full attention, experts with a gated "
                "shared expert",
    hf_mapping=QWEN3_NEXT,
)
