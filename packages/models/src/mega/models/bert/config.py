"""``BertConfig``: a transformer config plus what only BERT has, one field per flag.

BERT is a bidirectional encoder with post-LN layers (Devlin et al. 2018; Hugging Face's
``BertModel``), so of ``TransformerConfig``'s choices it takes learned absolute positions,
LayerNorm and a GELU MLP with biases, and rejects the rest with the flag that asked for them.
The binary (next-sentence / sentence-order) head is on by default, as in Megatron's
``pretrain_bert.py``: ``--bert-no-binary-head`` turns it off, ``--bert-binary-head`` on.
``--bert-pre-layernorm`` builds Megatron-LM's (megatron-core's ``BertModel``) BERT instead:
pre-LN layers, a final norm after the last one and no norm on the embeddings.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from mega.core.config.options import option
from mega.models.config import ModelConfigError, TransformerConfig


class BinaryHeadFlag(argparse.Action):
    """``--bert-binary-head`` sets the field True, its Megatron spelling ``--bert-no-binary-head``
    False: two flags, one field (argparse registers every string in ``option_strings``)."""

    NEGATIVE = "--bert-no-binary-head"

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.pop("nargs", None)
        super().__init__([*option_strings, self.NEGATIVE], dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string != self.NEGATIVE)


@dataclass(frozen=True)
class BertConfig(TransformerConfig):
    bert_binary_head: bool = option(True, "the binary (sentence-order) head and its pooler; "
                                    "--bert-no-binary-head: masked-LM head only", action=BinaryHeadFlag)
    num_tokentypes: int = option(2, "rows of the token-type (segment) embedding; 0: none")
    bert_pre_layernorm: bool = option(False, "Megatron-LM's BERT: pre-LN layers, a final norm, no embedding norm "
                                      "(default: post-LN layers and an embedding norm, Hugging Face's BERT)")

    def validate(self, tensor_parallel_size: int = 1) -> None:
        super().validate(tensor_parallel_size)
        wrong = {
            "--position-embedding-type (BERT learns absolute positions)": self.position_embedding_type != "learned_absolute",
            "--normalization (BERT uses LayerNorm)": self.normalization != "LayerNorm",
            "--swiglu (BERT has a GELU MLP)": self.swiglu,
            f"--activation {self.mlp_activation} (BERT has a GELU MLP)": self.mlp_activation in ("relu", "squared_relu"),
            "--disable-bias-linear (BERT's linear layers have biases)": not self.add_bias_linear,
            "--num-query-groups (BERT has one key/value head per query head)":
                self.num_query_groups != self.num_attention_heads,
        }
        unsupported = [flag for flag, differs in wrong.items() if differs]
        if unsupported:
            raise ModelConfigError(f"the bert family cannot build this model: {'; '.join(unsupported)}")
        if self.num_tokentypes < 0:
            raise ModelConfigError(f"--num-tokentypes must be >= 0, got {self.num_tokentypes}")
