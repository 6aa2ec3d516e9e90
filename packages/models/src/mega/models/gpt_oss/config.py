"""``GptOssConfig``: a mixture-of-experts decoder with gpt-oss's additions, as flags.

* attention sinks (``--softmax-type learnable``): a learned logit per head that joins every
  query's softmax denominator and attends to nothing (Megatron-Core's ``softmax_offset``);
* sliding-window layers alternating with full ones: ``--sliding-window`` on every layer but each
  ``--window-attn-skip-freq``-th (layers 0, 2, 4... slide, 1, 3, 5... see everything at 2);
* YaRN rotary (``--rope-type yarn`` and its factor, original context and betas; gpt-oss does
  not round the correction range, ``--no-yarn-truncate``);
* experts with biases whose SwiGLU is clamped: ``gate`` at most ``--swiglu-limit``, ``up`` within
  +-limit, then ``(up + 1) * gate * sigmoid(--swiglu-alpha * gate)``;
* a router with a bias; softmax over the top-k logits (mega's default routing).

The defaults are gpt-oss-20b's architecture (the sizes stay the shared small defaults).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mega.core.config.options import option, switch
from mega.models.config import need
from mega.models.moe.config import MoETransformerConfig


@dataclass(frozen=True)
class GptOssConfig(MoETransformerConfig):
    position_embedding_type: Literal["learned_absolute", "rope"] = option("rope", "learned_absolute or rope")
    rotary_base: float = option(150000.0, "RoPE theta")
    normalization: Literal["LayerNorm", "RMSNorm"] = option("RMSNorm", "LayerNorm or RMSNorm")
    untie_embeddings_and_output_weights: bool = option(True, "separate output layer weights [default here: True]",
                                                       action=switch("--tie-embeddings-and-output-weights"))
    hidden_dropout: float = option(0.0, "residual dropout")
    attention_dropout: float = option(0.0, "attention-probability dropout")
    sliding_window: int | None = option(128, "the sliding layers' window: a token attends to at most this many "
                                        "latest positions, itself included")
    num_experts: int = option(32, "experts per MoE layer")
    moe_router_topk: int = option(4, "experts each token is routed to")
    moe_aux_loss_coeff: float = option(0.001, "weight of the load-balancing loss")
    softmax_type: Literal["vanilla", "learnable"] = option(
        "learnable", "learnable: a learned logit per head joins the attention softmax's denominator (attention "
        "sinks, decoder.layers.N.self_attention.core_attention.softmax_offset); vanilla: none")
    window_attn_skip_freq: int | None = option(
        2, "every N-th layer (layers N-1, 2N-1, ...) attends to the whole context, the others within "
        "--sliding-window; none: every layer slides")
    rope_type: Literal["rope", "yarn"] = option("yarn", "rope, or YaRN's scaled frequencies")
    rotary_scaling_factor: float = option(32.0, "YaRN: how much longer the context is than the original")
    original_max_position_embeddings: int = option(4096, "YaRN: the context length the model was first trained for")
    beta_fast: float = option(32.0, "YaRN: rotations above which frequencies are kept")
    beta_slow: float = option(1.0, "YaRN: rotations below which frequencies are scaled")
    yarn_truncate: bool = option(False, "YaRN: round the correction range to whole dimensions (DeepSeek's; "
                                 "gpt-oss does not)", action=switch("--no-yarn-truncate"))
    swiglu_limit: float = option(7.0, "the experts' clamp: gate at most this, up within +-this")
    swiglu_alpha: float = option(1.702, "the experts' sigmoid gain: gate * sigmoid(alpha * gate)")

    def validate(self, tensor_parallel_size: int = 1) -> None:
        super().validate(tensor_parallel_size)
        need(self.position_embedding_type == "rope", "gpt-oss needs --position-embedding-type rope")
        need(self.softmax_type in ("vanilla", "learnable"), f"--softmax-type must be vanilla or learnable, "
             f"got {self.softmax_type!r}")
        need(self.rope_type in ("rope", "yarn"), f"--rope-type must be rope or yarn, got {self.rope_type!r}")
        need(self.window_attn_skip_freq is None or self.window_attn_skip_freq >= 1,
             f"--window-attn-skip-freq must be a positive integer, got {self.window_attn_skip_freq}")
        need(self.swiglu_limit > 0, f"--swiglu-limit must be positive, got {self.swiglu_limit}")
        need(not self.moe_router_pre_softmax and self.moe_router_score_function == "softmax",
             "gpt-oss routes by a softmax over the top-k logits (no --moe-router-pre-softmax, no sigmoid)")

    def layer_window(self, number: int) -> int | None:
        """Layer ``number``'s sliding window, or None where it attends to the whole context."""
        freq = self.window_attn_skip_freq
        if self.sliding_window is None or (freq is not None and (number + 1) % freq == 0):
            return None
        return self.sliding_window
