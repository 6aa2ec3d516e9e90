"""``TransformerConfig``: the shape and behaviour of a decoder-only transformer, one field per flag.

Field names follow Megatron's argument names; each field is declared once with
:func:`mega.core.config.options.option` (default, help line, and the flag where Megatron spells it
otherwise than the field name), the single source the CLI and TOML loaders are generated from. Fields left ``None`` are derived in ``__post_init__`` as
Megatron derives them (``ffn_hidden_size = 4 * hidden_size`` ...), so a config always holds
concrete sizes; ``dataclasses.replace`` keeps derived values unless they are replaced too.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Literal

from mega.core.config.options import option, switch

# The MLP activations: what the torch kernel backend (and so every --activation-backend) offers
# for an ungated MLP, and SwiGLU (gated: fc1 holds [gate; up], as --swiglu).
MLP_ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "squared_relu", "swiglu")
# The RoPE frequency kinds (Hugging Face's rope_type names; "rope" is their "default").
ROPE_TYPES = ("rope", "linear", "dynamic", "yarn", "llama3")
LLAMA3_ORIGINAL_CONTEXT = 8192  # LLaMA-3.1's original context: llama3 scaling's default (Megatron's fixed one)


class ModelConfigError(ValueError):
    """A model config that cannot be built; the message names the flags and the numbers."""


def need(condition: bool, message: str) -> None:
    """Raise ``ModelConfigError(message)`` unless ``condition`` holds."""
    if not condition:
        raise ModelConfigError(message)


def need_positive_integers(config, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        need(isinstance(value, int) and value > 0,
             f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")


def need_dropout_probabilities(config, names: tuple[str, ...] = ("hidden_dropout", "attention_dropout")) -> None:
    for name in names:
        value = getattr(config, name)
        need(0.0 <= value < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {value}")


@dataclass(frozen=True)
class TransformerConfig:
    # Shape.
    num_layers: int = option(2, "number of transformer layers")
    hidden_size: int = option(64, "transformer hidden size")
    ffn_hidden_size: int | None = option(None, "MLP hidden size; default 4*hidden (2/3 of that, rounded down to a multiple of 64, with --swiglu)")
    num_attention_heads: int = option(4, "attention heads")
    num_query_groups: int | None = option(None, "key/value heads for grouped-query attention; default one per attention head (multi-head attention)")
    kv_channels: int | None = option(None, "per-head size; default hidden/heads")
    seq_length: int = option(64, "tokens per training sample")
    max_position_embeddings: int | None = option(None, "rows of the learned position table; default seq length")
    vocab_size: int = option(512, "tokenizer vocabulary size (before padding)")
    make_vocab_size_divisible_by: int = option(128, "pad the vocabulary to a multiple of this times the tensor-parallel size")

    # Architecture choices.
    position_embedding_type: Literal["learned_absolute", "rope"] = option("learned_absolute", "learned_absolute or rope")
    rotary_base: float = option(10000.0, "RoPE theta")
    rope_type: str = option("rope", "RoPE frequencies: rope (plain); linear (positions divided by "
                            "--rotary-scaling-factor); dynamic (NTK-aware, its base grown by the sequence length "
                            "at run time past --original-max-position-embeddings); yarn (--beta-fast/--beta-slow, "
                            "cos and sin times the attention factor); llama3 (the same as --use-rope-scaling)",
                            choices=ROPE_TYPES)
    use_rope_scaling: bool = option(False, "LLaMA-3.1 RoPE frequency scaling (--rope-type llama3)")
    rope_scaling_factor: float = option(8.0, "llama3 RoPE scaling factor")
    rotary_scaling_factor: float = option(1.0, "linear, dynamic and yarn RoPE: how much longer the context is "
                                          "than the original")
    original_max_position_embeddings: int | None = option(
        None, "dynamic, yarn and llama3 RoPE: the context length the model was first trained for; default "
        "--max-position-embeddings (llama3: 8192)")
    rope_low_freq_factor: float = option(1.0, "llama3 RoPE: wavelengths above original context / this are "
                                         "scaled by the whole factor")
    rope_high_freq_factor: float = option(4.0, "llama3 RoPE: wavelengths below original context / this are kept")
    beta_fast: float = option(32.0, "YaRN: rotations above which frequencies are kept")
    beta_slow: float = option(1.0, "YaRN: rotations below which frequencies are scaled")
    yarn_truncate: bool = option(True, "YaRN: round the correction range to whole dimensions",
                                 action=switch("--no-yarn-truncate"))
    mscale: float | None = option(None, "YaRN: with --mscale-all-dim, the attention factor is "
                                  "mscale(--mscale) / mscale(--mscale-all-dim); default mscale(factor)")
    mscale_all_dim: float | None = option(None, "YaRN: the denominator's mscale of the attention factor")
    rope_attention_factor: float | None = option(None, "YaRN: the factor on RoPE's cos and sin, given outright "
                                                 "(default: from --mscale / --mscale-all-dim)")
    normalization: Literal["LayerNorm", "RMSNorm"] = option("LayerNorm", "LayerNorm or RMSNorm")
    layernorm_epsilon: float = option(1e-5, "norm epsilon", flag="--norm-epsilon")
    swiglu: bool = option(False, "SwiGLU MLP instead of GELU", action=switch("--no-swiglu"))
    openai_gelu: bool = option(False, "GELU with the tanh approximation (GPT-2's gelu_new)")
    squared_relu: bool = option(False, "squared ReLU MLP activation, relu(x)^2")
    activation: str | None = option(None, "MLP activation; default gelu, or what --swiglu / --squared-relu / "
                                    "--openai-gelu (gelu_tanh) say", choices=MLP_ACTIVATIONS)
    add_bias_linear: bool = option(True, "no biases in linear layers", flag="--disable-bias-linear",
                                   action=switch("--add-bias-linear"))
    add_qkv_bias: bool = option(False, "bias in the QKV projection even without other linear biases")
    qk_layernorm: bool = option(False, "normalise each query and key head (over its kv-channels, with --normalization) "
                                "before RoPE: QK-norm (Qwen3)", action=switch("--no-qk-layernorm"))
    qk_layernorm_scope: Literal["head", "projection"] = option(
        "head", "what QK-norm normalises: each head over its kv-channels (Qwen3), or the whole query and key "
        "projections at once (OLMo2; on one tensor-parallel rank)")
    layernorm_placement: Literal["pre", "post"] = option(
        "pre", "pre: each sublayer reads a normalised input (LLaMA); post: each sublayer's output is normalised "
        "before the residual add (OLMo2)")
    sliding_window: int | None = option(None, "each token attends to at most this many latest positions, itself "
                                        "included (Mistral's sliding window); default all")
    untie_embeddings_and_output_weights: bool = option(False, "separate output layer weights",
                                                       action=switch("--tie-embeddings-and-output-weights"))
    softmax_scale: float | None = option(None, "attention softmax scale; default 1/sqrt(kv_channels)")

    # Initialisation and regularisation.
    bias_gelu_fusion: bool = option(True, "add fc1's bias inside the GELU kernel (compiled on a GPU)",
                                    action=argparse.BooleanOptionalAction)
    bias_swiglu_fusion: bool = option(True, "add fc1's bias inside the SwiGLU kernel (compiled on a GPU)",
                                      action=argparse.BooleanOptionalAction)
    bias_dropout_fusion: bool = option(True, "dropout and the residual add in one kernel (compiled on a GPU "
                                       "where dropout is off)", action=argparse.BooleanOptionalAction)
    cross_entropy_loss_fusion: bool = option(False, "cross-entropy from the logits without an fp32 copy of them "
                                             "(compiled on a GPU; a vocabulary split by tensor parallelism "
                                             "keeps the vocab-parallel loss)")
    init_method_std: float = option(0.02, "std of the normal weight initialisation")
    hidden_dropout: float = option(0.1, "residual dropout")
    attention_dropout: float = option(0.1, "attention-probability dropout")

    # Memory.
    recompute_granularity: Literal["full", "selective"] | None = option(None, "full: whole layers; selective: the attention core only")
    recompute_method: Literal["uniform", "block"] | None = option(None, "uniform: every chunk of --recompute-num-layers layers; block: the first --recompute-num-layers layers of each stage")
    recompute_num_layers: int | None = option(None, "layers per recompute chunk/block")

    def __post_init__(self) -> None:
        derived = {}
        # --activation sets Megatron's flag of the same meaning, so whatever reads the flags (sizes,
        # plans, exports to Megatron-LM and Hugging Face) sees it; plain relu has no such flag.
        if self.activation == "swiglu":
            derived["swiglu"] = True  # the gated layout (fc1 [gate; up]) every size and plan reads
        if self.activation == "gelu_tanh":
            derived["openai_gelu"] = True
        if self.activation == "squared_relu":
            derived["squared_relu"] = True
        if self.kv_channels is None and self.num_attention_heads > 0:
            derived["kv_channels"] = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            derived["num_query_groups"] = self.num_attention_heads
        if self.ffn_hidden_size is None:
            ffn = 4 * self.hidden_size
            gated = derived.get("swiglu", self.swiglu)
            derived["ffn_hidden_size"] = int(ffn * 2 / 3 / 64) * 64 if gated else ffn
        if self.max_position_embeddings is None:
            derived["max_position_embeddings"] = self.seq_length
        if self.use_rope_scaling and self.rope_type == "rope":  # Megatron's spelling of llama3's scaling
            derived["rope_type"] = "llama3"
        if derived.get("rope_type", self.rope_type) == "llama3":
            derived["use_rope_scaling"] = True
            if self.original_max_position_embeddings is None:
                derived["original_max_position_embeddings"] = LLAMA3_ORIGINAL_CONTEXT
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        self.validate()

    def validate(self, tensor_parallel_size: int = 1) -> None:
        need_positive_integers(self, ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                                      "ffn_hidden_size", "kv_channels", "num_query_groups",
                                      "make_vocab_size_divisible_by"))
        heads, groups, tp = self.num_attention_heads, self.num_query_groups, tensor_parallel_size
        need(heads % groups == 0, f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
        need(self.position_embedding_type in ("learned_absolute", "rope"),
             f"--position-embedding-type must be learned_absolute or rope, got {self.position_embedding_type!r}")
        self._validate_rope_scaling()
        need(self.normalization in ("LayerNorm", "RMSNorm"),
             f"--normalization must be LayerNorm or RMSNorm, got {self.normalization!r}")
        if self.position_embedding_type == "learned_absolute":
            need(self.seq_length <= self.max_position_embeddings,
                 f"--seq-length {self.seq_length} exceeds --max-position-embeddings {self.max_position_embeddings}")
        else:
            need(self.kv_channels % 2 == 0, f"RoPE needs an even head size, got --kv-channels {self.kv_channels}")
        need(self.qk_layernorm_scope in ("head", "projection"),
             f"--qk-layernorm-scope must be head or projection, got {self.qk_layernorm_scope!r}")
        need(self.layernorm_placement in ("pre", "post"),
             f"--layernorm-placement must be pre or post, got {self.layernorm_placement!r}")
        need(self.sliding_window is None or (isinstance(self.sliding_window, int) and self.sliding_window > 0),
             f"--sliding-window must be a positive integer, got {self.sliding_window!r}")
        need_dropout_probabilities(self)
        self._validate_activation()
        self._validate_recompute()
        if tp > 1:
            need(heads % tp == 0, f"--num-attention-heads {heads} is not divisible by "
                 f"--tensor-model-parallel-size {tp}")
            need(groups % tp == 0, f"--num-query-groups {groups} is not divisible by "
                 f"--tensor-model-parallel-size {tp} (each rank must hold whole key/value groups)")
            need(not (self.qk_layernorm and self.qk_layernorm_scope == "projection"),
                 "--qk-layernorm-scope projection normalises the whole query and key projections, which "
                 f"--tensor-model-parallel-size {tp} splits across ranks; use one tensor-parallel rank")
            need(self.ffn_hidden_size % tp == 0, f"--ffn-hidden-size {self.ffn_hidden_size} is not "
                 f"divisible by --tensor-model-parallel-size {tp}")

    @property
    def mlp_activation(self) -> str:
        """The MLP's activation, by the name kernel backends give it (``--activation``, else the flags)."""
        if self.activation is not None:
            return self.activation
        if self.swiglu:
            return "swiglu"
        if self.squared_relu:
            return "squared_relu"
        return "gelu_tanh" if self.openai_gelu else "gelu"

    def _validate_activation(self) -> None:
        need(self.activation in (None, *MLP_ACTIVATIONS),
             f"--activation must be one of {', '.join(MLP_ACTIVATIONS)}, got {self.activation!r}")
        flags = {"--swiglu": ("swiglu", self.swiglu), "--squared-relu": ("squared_relu", self.squared_relu),
                 "--openai-gelu": ("gelu_tanh", self.openai_gelu)}
        chosen = {flag: name for flag, (name, on) in flags.items() if on}
        if self.activation is not None:
            chosen["--activation"] = self.activation
        need(len(set(chosen.values())) <= 1,
             "the MLP has one activation, these flags ask for several: "
             + ", ".join(f"{flag} ({name})" for flag, name in chosen.items()))

    def _validate_rope_scaling(self) -> None:
        need(self.rope_type in ROPE_TYPES, f"--rope-type must be one of {', '.join(ROPE_TYPES)}, "
             f"got {self.rope_type!r}")
        need(not self.use_rope_scaling or self.rope_type in ("rope", "llama3"),
             f"--use-rope-scaling is llama3's scaling; it cannot join --rope-type {self.rope_type}")
        if self.rope_type in ("linear", "dynamic", "yarn"):
            need(self.rotary_scaling_factor >= 1.0, f"--rope-type {self.rope_type} needs "
                 f"--rotary-scaling-factor >= 1, got {self.rotary_scaling_factor}")
        if self.rope_type == "llama3" or self.use_rope_scaling:
            need(self.rope_low_freq_factor < self.rope_high_freq_factor, "llama3 RoPE needs --rope-low-freq-factor "
                 f"{self.rope_low_freq_factor} below --rope-high-freq-factor {self.rope_high_freq_factor}")

    def _validate_recompute(self) -> None:
        granularity, method, count = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if granularity not in (None, "full", "selective"):
            raise ModelConfigError(f"--recompute-granularity must be full or selective, got {granularity!r}")
        if granularity == "full":
            if method not in ("uniform", "block"):
                raise ModelConfigError("--recompute-granularity full needs --recompute-method uniform or block")
            if not isinstance(count, int) or count < 1:
                raise ModelConfigError("--recompute-granularity full needs --recompute-num-layers >= 1, "
                                       f"got {count!r}")
        elif method is not None:
            raise ModelConfigError(f"--recompute-method {method} needs --recompute-granularity full")

    # Derived sizes the model and its formulas share.
    @property
    def query_projection_size(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_projection_size(self) -> int:
        return self.num_query_groups * self.kv_channels

    @property
    def attention_softmax_scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.kv_channels)

    def padded_vocab_size(self, tensor_parallel_size: int = 1) -> int:
        """Megatron's padding: the next multiple of make_vocab_size_divisible_by * tp."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return math.ceil(self.vocab_size / multiple) * multiple
