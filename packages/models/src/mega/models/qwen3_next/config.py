"""``HybridLinearAttentionConfig``: a mixture-of-experts decoder whose layers alternate Gated
DeltaNet linear attention with gated full attention (Qwen3-Next); ``Qwen3NextConfig`` is it with
Qwen3-Next's architecture as the defaults.

The new fields are Megatron-LM's flags for its Qwen3-Next support (``--linear-attention-freq``,
``--linear-conv-kernel-dim``, ``--linear-key-head-dim`` ... ``--attention-output-gate``,
``--moe-shared-expert-gate``, ``--rotary-percent``). Every ``--linear-attention-freq``-th layer
(layers ``N-1, 2N-1, ...``) is full attention, the others linear: Hugging Face's
``full_attention_interval``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mega.core.config.options import option
from mega.models.config import need
from mega.models.family_defaults import with_defaults
from mega.models.moe.config import MoETransformerConfig
from mega.models.qwen3.config import QWEN3


@dataclass(frozen=True)
class HybridLinearAttentionConfig(MoETransformerConfig):
    linear_attention_freq: int = option(4, "every Nth layer (N-1, 2N-1, ...) is full attention, the others Gated "
                                        "DeltaNet linear attention (Hugging Face's full_attention_interval)")
    linear_conv_kernel_dim: int = option(4, "width of the linear layers' causal depthwise convolution")
    linear_key_head_dim: int = option(128, "key (and query) channels per linear-attention head")
    linear_value_head_dim: int = option(128, "value channels per linear-attention head")
    linear_num_key_heads: int = option(16, "key (and query) heads of the linear layers")
    linear_num_value_heads: int = option(32, "value heads of the linear layers (a multiple of the key heads)")
    gated_delta_rule_chunk_size: int = option(64, "tokens per chunk of the chunked gated delta rule (training "
                                              "and prefill; the result does not depend on it)")
    rotary_percent: float = option(1.0, "fraction of each attention head's channels that RoPE rotates (the "
                                   "first ones; Qwen3-Next: 0.25)")
    moe_shared_expert_gate: bool = option(False, "scale the shared expert's output by sigmoid(a learned "
                                          "projection of the input) per token")
    mtp_num_layers: int | None = option(None, "multi-token prediction: modules predicting tokens 2..N+1 ahead "
                                        "on the last pipeline stage (each a full-attention layer)")
    mtp_loss_scaling_factor: float = option(0.1, "weight of the mean multi-token-prediction loss in the loss")

    def validate(self, tensor_parallel_size: int = 1) -> None:
        super().validate(tensor_parallel_size)
        for name in ("linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "gated_delta_rule_chunk_size"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"--{name.replace('_', '-')} must be a positive integer, "
                 f"got {value!r}")
        keys, values, tp = self.linear_num_key_heads, self.linear_num_value_heads, tensor_parallel_size
        need(values % keys == 0, f"--linear-num-value-heads {values} is not a multiple of --linear-num-key-heads {keys}")
        need(keys % tp == 0, f"--linear-num-key-heads {keys} is not divisible by --tensor-model-parallel-size {tp} "
             "(each rank holds whole key heads and their value heads)")
        rotary = self.rotary_dim
        need(0 < self.rotary_percent <= 1 and rotary % 2 == 0 and rotary > 0,
             f"--rotary-percent {self.rotary_percent} of --kv-channels {self.kv_channels} must give a positive even "
             f"number of rotated channels, got {rotary}")
        need(self.position_embedding_type == "rope", "the hybrid layers' attention needs --position-embedding-type rope")
        need(self.mtp_num_layers is None or self.mtp_num_layers >= 0,
             f"--mtp-num-layers must be >= 0, got {self.mtp_num_layers}")

    @property
    def rotary_dim(self) -> int:
        return int(self.kv_channels * self.rotary_percent)

    def is_linear_layer(self, number: int) -> bool:
        """Whether layer ``number`` (0-based) is Gated DeltaNet linear attention."""
        return (number + 1) % self.linear_attention_freq != 0

    @property
    def num_linear_layers(self) -> int:
        return sum(self.is_linear_layer(n) for n in range(self.num_layers))


QWEN3_NEXT = dict(QWEN3, qk_layernorm=True, rotary_base=1e7, rotary_percent=0.25, moe_shared_expert_intermediate_size=512,
                  moe_shared_expert_gate=True, moe_aux_loss_coeff=0.001, hidden_dropout=0.0, attention_dropout=0.0)

Qwen3NextConfig = with_defaults(
    HybridLinearAttentionConfig, "Qwen3NextConfig", module=__name__,
    doc="Qwen3-Next: Gated DeltaNet and gated full attention (3 to 1), zero-centred RMSNorms, partial RoPE, "
        "experts with a gated shared expert.", **QWEN3_NEXT)
