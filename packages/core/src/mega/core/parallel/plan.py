"""Tensor-parallel plans: how a model written for one device is split over the tensor group.

A model family declares a plan, a mapping from module-name patterns (``fnmatch`` syntax over
``named_modules()`` names, e.g. ``"decoder.layers.*.self_attention.linear_qkv"``) to one of the
styles below. The core swaps each matching ``nn.Linear`` / ``nn.Embedding`` for its parallel
counterpart, taking this rank's shard of the already-initialised full weight, so a seed gives
the same full model at every layout.

Activations inside the transformer are laid out ``[sequence, batch, hidden]`` as in Megatron,
so sequence parallelism splits and gathers along dimension 0 without copies.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Colwise:
    """``nn.Linear`` -> ColumnParallelLinear: output features split over the tensor group.

    ``chunks`` > 1 means the weight's output rows are ``chunks`` blocks stacked (SwiGLU's gate
    and up projections): each block is split on its own, so a rank holds its slice of every block.
    Under sequence parallelism the input is all-gathered along the sequence first.
    ``gather_output`` all-gathers the output features (rarely wanted; the LM head keeps its
    vocabulary shard for the vocab-parallel cross-entropy).
    """

    chunks: int = 1
    gather_output: bool = False


@dataclass(frozen=True)
class Rowwise:
    """``nn.Linear`` -> RowParallelLinear: input features split; partial outputs summed.

    The sum is an all-reduce, or a reduce-scatter along the sequence under sequence parallelism.
    """


@dataclass(frozen=True)
class VocabEmbedding:
    """``nn.Embedding`` -> VocabParallelEmbedding: rows (the vocabulary) split; lookups summed."""


@dataclass(frozen=True)
class SequenceParallelOutput:
    """Any module: under sequence parallelism its ``[s, b, h]`` output is split along ``s``.

    Marks where the sequence-parallel region starts (after the embeddings). Without sequence
    parallelism it does nothing.
    """


@dataclass(frozen=True)
class ColumnThenRow:
    """A module holding a column-parallel layer that feeds a row-parallel one (a fused MLP:
    fc1 split by output features, in ``chunks`` blocks as :class:`Colwise`; fc2 by input
    features, its partial outputs summed as :class:`Rowwise`). Only a kernel's module that does
    its own communication (``to_tensor_parallel``) can be split this way.
    """

    chunks: int = 1


PlanStyle = Colwise | Rowwise | VocabEmbedding | SequenceParallelOutput | ColumnThenRow
