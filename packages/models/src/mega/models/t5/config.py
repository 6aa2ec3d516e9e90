"""``T5Config``: the shape of an encoder-decoder T5, one field per flag.

T5 differs from the decoder-only config in ways that are not options there: relative-position
buckets instead of position embeddings, RMS-style norms without bias (T5's LayerNorm), no
biases, no attention scaling (T5 folds 1/sqrt(d) into the initialisation) and two sequence
lengths. Megatron-LM's T5 (``pretrain_t5.py`` by default) has learned absolute positions, one
table shared by both stacks, LayerNorm and biases everywhere: options here. ``seq_length`` is the encoder's (Megatron's ``pretrain_t5.py`` spells it
``--encoder-seq-length``; both flags are accepted), ``decoder_seq_length`` the decoder's.

The fields shared modules read (``hidden_size``, ``attention_dropout``, ``normalization``...)
have the decoder-only config's names, so the attention core and norms are reused as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mega.core.config.options import option
from mega.models.config import need, need_dropout_probabilities, need_positive_integers

FEED_FORWARD_KINDS = ("relu", "gated-gelu", "gelu")
POSITION_KINDS = ("relative", "learned_absolute")
NORM_KINDS = ("RMSNorm", "LayerNorm")


@dataclass(frozen=True)
class T5Config:
    # Shape.
    num_layers: int = option(2, "encoder layers (Megatron's --encoder-num-layers)")
    decoder_num_layers: int | None = option(None, "decoder layers; default as many as the encoder")
    hidden_size: int = option(64, "model width (d_model)")
    ffn_hidden_size: int | None = option(None, "MLP hidden size (d_ff); default 4*hidden")
    num_attention_heads: int = option(4, "attention heads")
    kv_channels: int | None = option(None, "per-head size (d_kv); default hidden/heads")
    seq_length: int = option(64, "encoder tokens per sample (also --encoder-seq-length)")
    encoder_seq_length: int | None = option(None, "Megatron pretrain_t5's name for --seq-length")
    decoder_seq_length: int = option(32, "decoder tokens per sample")
    vocab_size: int = option(512, "tokenizer vocabulary size (before padding), sentinels included")
    make_vocab_size_divisible_by: int = option(128, "pad the vocabulary to a multiple of this times the tensor-parallel size")

    # Architecture choices.
    position_embedding_type: Literal["relative", "learned_absolute"] = option(
        "relative", "relative (T5's buckets) or learned_absolute (one table for both stacks: Megatron-LM's T5 default)")
    max_position_embeddings: int | None = option(
        None, "learned_absolute: rows of the position table; default the longer of the two sequence lengths")
    normalization: Literal["RMSNorm", "LayerNorm"] = option(
        "RMSNorm", "RMSNorm (T5's, no bias) or LayerNorm (with bias: Megatron-LM's T5 default)")
    add_bias_linear: bool = option(False, "a bias on every linear layer of both stacks (Megatron-LM's T5 default)")
    relative_attention_num_buckets: int = option(32, "relative-position buckets")
    relative_attention_max_distance: int = option(128, "distance beyond which relative positions share a bucket")
    feed_forward_proj: Literal["relu", "gated-gelu", "gelu"] = option(
        "relu", "relu (T5 v1.0), gated-gelu (T5 v1.1, Flan-T5) or gelu (exact, ungated: Megatron-LM's T5)")
    layernorm_epsilon: float = option(1e-6, "norm epsilon", flag="--norm-epsilon")
    untie_embeddings_and_output_weights: bool = option(False, "separate output layer weights (T5 v1.1)")
    # Where Megatron-Core's T5 differs from Google's (Megatron-LM checkpoints set these).
    softmax_scale: float = option(1.0, "attention softmax scale: 1 as in T5, which folds 1/sqrt(d) into its "
                                  "initialisation; Megatron-Core's T5 scales by 1/sqrt(kv_channels)")
    scale_tied_output: bool = option(True, "feed a tied output layer the decoder's output as it is, as Megatron-Core's "
                                     "T5 does (T5 scales it by hidden_size**-0.5 first)",
                                     flag="--no-scale-tied-output")
    output_layer_bias: bool = option(False, "a bias on the output layer (Megatron-Core's T5 has one when tied)")
    pipeline_model_parallel_split_rank: int | None = option(
        None, "pipeline stages that hold the encoder (the rest hold the decoder); default: encoder and decoder "
        "layers split evenly over all stages as one sequence")

    # Initialisation and regularisation.
    init_method_std: float = option(0.02, "std of the normal weight initialisation")
    hidden_dropout: float = option(0.1, "residual dropout")
    attention_dropout: float = option(0.1, "attention-probability dropout")

    def __post_init__(self) -> None:
        derived = {}
        if self.encoder_seq_length is not None:
            # An alias only: it sets seq_length and is cleared, so replace() stays consistent.
            derived["seq_length"], derived["encoder_seq_length"] = self.encoder_seq_length, None
        if self.decoder_num_layers is None:
            derived["decoder_num_layers"] = self.num_layers
        if self.kv_channels is None and self.num_attention_heads > 0:
            derived["kv_channels"] = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            derived["ffn_hidden_size"] = 4 * self.hidden_size
        if self.max_position_embeddings is None and self.position_embedding_type == "learned_absolute":
            derived["max_position_embeddings"] = max(derived.get("seq_length", self.seq_length),
                                                     self.decoder_seq_length)
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        self.validate()

    def validate(self, tensor_parallel_size: int = 1) -> None:
        need_positive_integers(self, ("num_layers", "decoder_num_layers", "hidden_size", "ffn_hidden_size",
                                      "num_attention_heads", "kv_channels", "seq_length", "decoder_seq_length",
                                      "vocab_size", "make_vocab_size_divisible_by",
                                      "relative_attention_num_buckets", "relative_attention_max_distance"))
        need(self.relative_attention_num_buckets >= 4, "--relative-attention-num-buckets must be at least 4 "
             f"(half exact, half logarithmic, each way), got {self.relative_attention_num_buckets}")
        need(self.feed_forward_proj in FEED_FORWARD_KINDS,
             f"--feed-forward-proj must be one of {', '.join(FEED_FORWARD_KINDS)}, got {self.feed_forward_proj!r}")
        need(self.position_embedding_type in POSITION_KINDS, f"--position-embedding-type must be one of "
             f"{', '.join(POSITION_KINDS)}, got {self.position_embedding_type!r}")
        need(self.normalization in NORM_KINDS,
             f"--normalization must be one of {', '.join(NORM_KINDS)}, got {self.normalization!r}")
        if self.position_embedding_type == "learned_absolute":
            longest = max(self.seq_length, self.decoder_seq_length)
            need(self.max_position_embeddings >= longest, f"--max-position-embeddings {self.max_position_embeddings} "
                 f"is shorter than the longest sequence ({longest})")
        need(self.softmax_scale > 0, f"--softmax-scale must be positive, got {self.softmax_scale}")
        need_dropout_probabilities(self)
        tp = tensor_parallel_size
        if tp > 1:
            need(self.num_attention_heads % tp == 0, f"--num-attention-heads {self.num_attention_heads} is not "
                 f"divisible by --tensor-model-parallel-size {tp}")
            need(self.ffn_hidden_size % tp == 0, f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by "
                 f"--tensor-model-parallel-size {tp}")

    # Derived sizes the model and its formulas share.
    @property
    def gated(self) -> bool:
        return self.feed_forward_proj == "gated-gelu"

    @property
    def attention_softmax_scale(self) -> float:
        return self.softmax_scale

    @property
    def relative(self) -> bool:
        return self.position_embedding_type == "relative"

    @property
    def num_query_groups(self) -> int:  # multi-head attention: one key/value head per query head
        return self.num_attention_heads

    @property
    def query_projection_size(self) -> int:
        return self.num_attention_heads * self.kv_channels

    def padded_vocab_size(self, tensor_parallel_size: int = 1) -> int:
        """Megatron's padding: the next multiple of make_vocab_size_divisible_by * tp."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return math.ceil(self.vocab_size / multiple) * multiple
