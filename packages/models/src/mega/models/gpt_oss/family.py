"""The ``gpt-oss`` family: OpenAI's gpt-oss, a mixture-of-experts decoder with attention sinks,
sliding-window layers alternating with full ones, YaRN rotary and clamped SwiGLU experts with
biases (:mod:`mega.models.gpt_oss.config`).

Presets are the released models' Hugging Face configs: gpt-oss-20b (24 layers, 32 experts) and
gpt-oss-120b (36 layers, 128 experts); both hidden 2880, experts of 2880, top-4, 64 heads of 64
over 8 key/value heads, a 128-token window on every other layer, a 201088-token vocabulary,
RoPE theta 150000 with YaRN x32 over an original 4096 positions (131072 in all). ``tiny`` is a
2-layer, 4-expert model for tests and demos.
"""

from __future__ import annotations

from mega.core.model_family import ModelFamily
from mega.models.gpt_oss.config import GptOssConfig
from mega.models.gpt_oss.hf_gpt_oss import GPT_OSS
from mega.models.gpt_oss.memory import gpt_oss_stage_footprint
from mega.models.gpt_oss.model import (
    GPT_OSS_PASSES,
    build_gpt_oss_model,
    init_gpt_oss_parameter,
    num_gpt_oss_floating_point_operations,
    num_gpt_oss_parameters,
)
from mega.models.mixtral.family import FAMILY as MIXTRAL


def gpt_oss_config(num_layers: int, num_experts: int, **overrides) -> GptOssConfig:
    settings = dict(
        num_layers=num_layers, hidden_size=2880, ffn_hidden_size=2880, moe_ffn_hidden_size=2880,
        num_attention_heads=64, num_query_groups=8, kv_channels=64, num_experts=num_experts, moe_router_topk=4,
        seq_length=4096, max_position_embeddings=131072, vocab_size=201088, layernorm_epsilon=1e-5,
        add_bias_linear=True, init_method_std=0.02,
    )
    settings.update(overrides)
    return GptOssConfig(**settings)


PRESETS = {
    "tiny": gpt_oss_config(2, 4, hidden_size=64, ffn_hidden_size=64, moe_ffn_hidden_size=64, num_attention_heads=4,
                           num_query_groups=2, kv_channels=16, moe_router_topk=2, seq_length=128,
                           max_position_embeddings=512, vocab_size=512, sliding_window=32,
                           original_max_position_embeddings=128),
    "20b": gpt_oss_config(24, 32),
    "120b": gpt_oss_config(36, 128),
}

FAMILY = ModelFamily(
    name="gpt-oss",
    config_class=GptOssConfig,
    presets=PRESETS,
    build=build_gpt_oss_model,
    init_parameter=init_gpt_oss_parameter,
    loss=MIXTRAL.loss,
    num_parameters=num_gpt_oss_parameters,
    num_floating_point_operations=num_gpt_oss_floating_point_operations,
    tensor_parallel_plan=MIXTRAL.tensor_parallel_plan,
    setup_passes=GPT_OSS_PASSES,
    boundary=MIXTRAL.boundary,
    features=frozenset({"moe"}),
    memory_model=gpt_oss_stage_footprint,
    description="gpt-oss: attention sinks, alternating sliding-window layers, YaRN, clamped SwiGLU experts with biases",
    hf_mapping=GPT_OSS,
)
