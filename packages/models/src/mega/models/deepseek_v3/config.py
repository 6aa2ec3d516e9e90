"""``MLATransformerConfig``: a mixture-of-experts decoder with multi-latent attention, YaRN RoPE and
multi-token prediction; Megatron-LM's flags (its ``MLATransformerConfig`` fields).

Hugging Face's names for the same sizes: ``qk_nope_head_dim`` is ``--qk-head-dim``,
``qk_rope_head_dim`` is ``--qk-pos-emb-head-dim``; the first ``first_k_dense_replace`` dense
layers are ``--moe-layer-freq '[0]*k+[1]*(L-k)'``. The deepseek-v3 family's class,
``DeepSeekV3Config``, is this one with DeepSeek-V3's architecture as its defaults
(below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mega.core.config.options import option
from mega.models.config import need
from mega.models.family_defaults import with_defaults
from mega.models.llama.config import LLAMA
from mega.models.moe.config import MoETransformerConfig


@dataclass(frozen=True)
class MLATransformerConfig(MoETransformerConfig):
    multi_latent_attention: bool = option(True, "multi-latent attention (low-rank compressed queries and keys/values)")
    q_lora_rank: int | None = option(None, "rank of the query bottleneck (none: one query projection)")
    kv_lora_rank: int = option(512, "rank of the key/value bottleneck (the latent a generation cache keeps)")
    qk_head_dim: int = option(128, "query/key channels per head without positions (Hugging Face's qk_nope_head_dim)")
    qk_pos_emb_head_dim: int = option(64, "query/key channels per head that carry RoPE (qk_rope_head_dim), the key's "
                                      "shared by all heads")
    v_head_dim: int = option(128, "value channels per head")
    rope_type: Literal["rope", "yarn"] = option("yarn", "rope, or YaRN's scaled frequencies (multi-latent attention)")
    rotary_scaling_factor: float = option(40.0, "YaRN: how much longer the context is than the original")
    original_max_position_embeddings: int = option(4096, "YaRN: the context length the model was first trained for")
    mscale: float = option(1.0, "YaRN: mscale of the rotary attention factor")
    mscale_all_dim: float = option(1.0, "YaRN: mscale of the softmax scale (squared) and of the attention factor")
    mtp_num_layers: int | None = option(None, "multi-token prediction: modules predicting tokens 2..N+1 ahead "
                                        "on the last pipeline stage")
    mtp_loss_scaling_factor: float = option(0.1, "weight of the mean multi-token-prediction loss in the loss")

    def validate(self, tensor_parallel_size: int = 1) -> None:
        super().validate(tensor_parallel_size)
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        need(self.q_lora_rank is None or self.q_lora_rank > 0, f"--q-lora-rank must be positive, got {self.q_lora_rank}")
        need(self.multi_latent_attention, "the deepseek-v3 family's attention is multi-latent (--multi-latent-attention)")
        need(self.sliding_window is None, f"--sliding-window {self.sliding_window}: multi-latent attention has no "
             "sliding window")
        need(self.qk_pos_emb_head_dim % 2 == 0, f"RoPE needs an even --qk-pos-emb-head-dim, got {self.qk_pos_emb_head_dim}")
        need((self.kv_lora_rank + self.qk_pos_emb_head_dim) % 2 == 0,
             "--kv-lora-rank + --qk-pos-emb-head-dim must be even (the generation cache holds them as two halves)")
        need(self.position_embedding_type == "rope", "multi-latent attention needs --position-embedding-type rope")
        need(self.rope_type in ("rope", "yarn"), f"--rope-type must be rope or yarn, got {self.rope_type!r}")
        need(self.mtp_num_layers is None or self.mtp_num_layers >= 0,
             f"--mtp-num-layers must be >= 0, got {self.mtp_num_layers}")


DeepSeekV3Config = with_defaults(
    MLATransformerConfig, "DeepSeekV3Config", module=__name__, doc="DeepSeek-V3: multi-latent attention with YaRN RoPE, RMSNorm "
    "(epsilon 1e-6), SwiGLU experts routed by sigmoid with a correction bias, no biases, untied.",
    **dict(LLAMA, rotary_base=10000.0, layernorm_epsilon=1e-6), moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True)
