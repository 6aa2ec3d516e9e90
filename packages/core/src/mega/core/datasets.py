"""The dataset contract between the training loop and dataset plugins.

A dataset plugin registers (``register_datasets``) a builder ``build(request) -> TrainingData``.
Each split is ``None`` or a sized, indexable dataset whose item ``i`` is a mapping with
``tokens`` and ``labels`` (integer arrays of ``seq_length``: the inputs and the next tokens)
and optionally ``loss_mask`` (1.0 where a label counts): the shape of Megatron's ``GPTDataset``
samples; samples whose rows hold several documents (packed sequences, ``--reset-attention-mask``)
add ``document_ids`` (``[seq]`` integers, equal within a document, increasing along the row) and
``position_ids``. Every rank calls the builder at the same time; a builder that caches indices or
prepares files coordinates that itself (rank 0 builds, the others wait and load).

Families whose samples are not GPT's (BERT's masked-LM pairs, T5's span corruption) name their
builders in ``ModelFamily.datasets``; those samples are dicts of the family's ``batch_keys``
under Megatron's names (``text``, ``types``, ``is_random``, ``padding_mask``; ``text_enc``,
``text_dec``, ``enc_mask``, ``dec_mask``...).

A builder that brings its own tokenizer (a corpus it prepares, say) returns it in
``TrainingData.tokenizer``; the model's vocabulary then follows that tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DatasetRequest:
    data_path: list[str] | None  # prefixes, or weight/prefix pairs
    split: str  # "969,30,1"
    seq_length: int
    seed: int
    num_samples: tuple[int, int, int]  # train, valid, test samples the run will read
    cache_path: str | None
    tokenizer: Any | None  # a mega.core.tokenizer.Tokenizer, when the run has one
    vocab_size: int  # of the model (before padding); mock data draws tokens below it
    model: Any = None  # the family's model config (an encoder-decoder's lengths, BERT's binary head)
    mask_prob: float = 0.15  # masked-LM / span-corruption share of tokens (--mask-prob)
    short_seq_prob: float = 0.1  # chance of a shorter target length (--short-seq-prob)
    packed_sequences: bool = False  # sft: several conversations per row (--packed-sequences)
    # Packed rows: each document's length rounded up to a multiple of this (2 x --context-parallel-size,
    # so that context parallelism cuts every document into equal chunks); 1: as it is.
    pad_documents_to: int = 1
    reset_position_ids: bool = False  # GPT data: Megatron's --reset-position-ids
    reset_attention_mask: bool = False  # GPT data: documents kept apart (samples carry document_ids)
    eod_mask_loss: bool = False  # GPT data: end-of-document tokens out of the loss


@dataclass
class TrainingData:
    train: Any
    valid: Any = None
    test: Any = None
    tokenizer: Any = None  # set when the builder chose the tokenizer itself
    tokenizer_spec: Any = None  # a mega.core.tokenizer.TokenizerSpec rebuilding ``tokenizer`` (for checkpoints)
