"""Tensor-parallel layers: each rank holds a slice of a weight and collectives join the pieces.

* :class:`ColumnParallelLinear` splits the output features: ``Y_i = X A_i``. Its input is
  replicated (the gradient is all-reduced) or, under sequence parallelism, all-gathered along the
  sequence (the gradient is reduce-scattered).
* :class:`RowParallelLinear` splits the input features: ``Y = sum_i X_i A_i``, the sum an
  all-reduce, or a reduce-scatter along the sequence under sequence parallelism.
* :class:`VocabParallelEmbedding` splits the vocabulary rows; each rank looks up the ids it owns
  and the partial embeddings are summed.

Initialisation does not depend on the layout: ``reset_parameters`` draws the *full* weight the
way ``nn.Linear`` / ``nn.Embedding`` would and keeps this rank's shard, so with the same seed
every layout holds slices of the same model. ``from_linear`` / ``from_embedding`` take the shard
of an existing module, which is how :func:`~mega.core.parallel.tensor_parallel.apply_tensor_parallel`
parallelises a model built for one device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mega.core.parallel.collectives import (
    copy_to_tensor_parallel_region,
    gather_along,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from mega.core.parallel.grad_accumulation_fusion import linear
from mega.core.parallel.groups import Group
from mega.core.parallel.param_attrs import mark_sequence_parallel, mark_tensor_parallel


def shard_of(full: torch.Tensor, group: Group, dim: int, chunks: int = 1) -> torch.Tensor:
    """This rank's shard of ``full`` along ``dim``; with ``chunks`` > 1 a slice of every block."""
    if full.shape[dim] % (chunks * group.size):
        raise ValueError(
            f"dimension {dim} of size {full.shape[dim]} cannot be split into {chunks} block(s) "
            f"over the {group.name} group of size {group.size}"
        )
    blocks = full.chunk(chunks, dim=dim)
    return torch.cat([block.chunk(group.size, dim=dim)[group.rank] for block in blocks], dim=dim).clone()


def gather_shards(shard: torch.Tensor, group: Group, dim: int, chunks: int = 1) -> torch.Tensor:
    """The full tensor from every rank's :func:`shard_of` (a collective; no autograd)."""
    pieces = gather_along(shard.detach(), group, dim).chunk(group.size, dim=dim)
    # Rank i's shard holds its slice of each block: regroup the slices block by block.
    per_rank = [piece.chunk(chunks, dim=dim) for piece in pieces]
    return torch.cat([per_rank[r][c] for c in range(chunks) for r in range(group.size)], dim=dim)


def _init_linear_(weight: torch.Tensor, bias: torch.Tensor | None, in_features: int) -> None:
    # nn.Linear.reset_parameters, applied to the full tensors.
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


class _ShardedLinear(nn.Module):
    """What the two parallel linears share: full sizes, local shards, layout-free init."""

    partition_dim: int  # 0: output features split (column), 1: input features split (row)

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool, chunks: int,
                 sequence_parallel: bool, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.chunks, self.sequence_parallel = group, chunks, sequence_parallel
        shape = [out_features, in_features]
        split = shape[self.partition_dim]
        if split % (chunks * group.size):
            what = "output" if self.partition_dim == 0 else "input"
            blocks = f" in {chunks} blocks" if chunks > 1 else ""
            raise ValueError(
                f"{type(self).__name__}: {what} features {split} cannot be split{blocks} over "
                f"tensor-parallel size {group.size}"
            )
        shape[self.partition_dim] //= group.size
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype)) if bias else None
        self._mark_params()
        if not self.weight.is_meta:
            self.reset_parameters()

    def _mark_params(self) -> None:
        mark_tensor_parallel(self.weight, self.partition_dim, self.chunks)
        if self.bias is None:
            return
        if self.partition_dim == 0:
            mark_tensor_parallel(self.bias, 0, self.chunks)
        elif self.sequence_parallel:
            # Row-parallel bias: added after the reduce-scatter, on sequence shards.
            mark_sequence_parallel(self.bias)

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation of the full weight; this rank keeps its shard."""
        full_weight = torch.empty(self.out_features, self.in_features, device=self.weight.device,
                                  dtype=self.weight.dtype)
        full_bias = None if self.bias is None else full_weight.new_empty(self.out_features)
        _init_linear_(full_weight, full_bias, self.in_features)
        self.load_full(full_weight, full_bias)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's shard of the full ``weight`` (and ``bias``) into the layer."""
        self.weight.copy_(shard_of(weight, self.group, self.partition_dim, self.chunks))
        if self.bias is not None and bias is not None:
            self.bias.copy_(shard_of(bias, self.group, 0, self.chunks) if self.partition_dim == 0 else bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, **options):
        """The parallel layer holding this rank's shard of ``linear``'s weights."""
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device="meta", dtype=linear.weight.dtype, **options)
        layer.to_empty(device=linear.weight.device)  # new Parameter objects: mark them again
        layer._mark_params()
        layer.load_full(linear.weight, linear.bias)
        layer.weight.requires_grad_(linear.weight.requires_grad)
        return layer

    def local_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """This rank's product ``x @ weight_shard.T (+ bias)``, between the layer's collectives;
        a subclass computes it otherwise (FP8: mega-torchao's layers)."""
        return linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp={self.group.size}, "
                f"sequence_parallel={self.sequence_parallel}")


class ColumnParallelLinear(_ShardedLinear):
    """``nn.Linear`` with the output features split over the tensor group.

    ``chunks`` > 1: the output is that many stacked blocks (fused SwiGLU gate/up) and each rank
    holds its slice of every block, so ``output.chunk(chunks, -1)`` still separates them.
    ``gather_output`` all-gathers the output features (not allowed with chunks, it would
    interleave the blocks). Under ``sequence_parallel`` the input ``[s/tp, b, h]`` is all-gathered
    along the sequence first.
    """

    partition_dim = 0

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, chunks: int = 1,
                 device=None, dtype=None):
        if gather_output and chunks > 1:
            raise ValueError("ColumnParallelLinear: gather_output with chunks > 1 would interleave the blocks")
        self.gather_output = gather_output
        super().__init__(in_features, out_features, group, bias, chunks, sequence_parallel, device, dtype)

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """``add_bias=False`` leaves the bias to the caller (a fused bias + activation)."""
        y = self.local_linear(self.local_input(x), self.bias if add_bias else None)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y

    def local_input(self, x: torch.Tensor) -> torch.Tensor:
        """What this rank's product takes: ``x`` gathered along the sequence under sequence
        parallelism, else ``x`` itself (its gradient all-reduced over the group in backward)."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, self.group)
        return copy_to_tensor_parallel_region(x, self.group)


class RowParallelLinear(_ShardedLinear):
    """``nn.Linear`` with the input features split over the tensor group.

    The input is already split (it comes from a column-parallel layer). Partial products are
    summed by an all-reduce, or under ``sequence_parallel`` by a reduce-scatter along the
    sequence. The bias is added once, after the sum; under sequence parallelism it is marked so
    its gradient (computed on sequence shards) is summed over the tensor group.
    """

    partition_dim = 1

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = True,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__(in_features, out_features, group, bias, 1, sequence_parallel, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local_linear(x, None)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the vocabulary rows split over the tensor group.

    Rank ``r`` owns ids ``[r*V/tp, (r+1)*V/tp)``; other ids look up zeros and the all-reduce
    fills them in. The vocabulary must divide by tp (pad it, as Megatron pads to a multiple
    of 128*tp).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group, *,
                 padding_idx: int | None = None, device=None, dtype=None):
        super().__init__()
        if num_embeddings % group.size:
            raise ValueError(
                f"VocabParallelEmbedding: vocabulary size {num_embeddings} is not divisible by "
                f"tensor-parallel size {group.size}; pad the vocabulary (e.g. to a multiple of "
                f"128*tp = {128 * group.size})"
            )
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.padding_idx = padding_idx
        per_rank = num_embeddings // group.size
        self.vocab_start, self.vocab_end = group.rank * per_rank, (group.rank + 1) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=device, dtype=dtype))
        self._mark_params()
        if not self.weight.is_meta:
            self.reset_parameters()

    def _mark_params(self) -> None:
        mark_tensor_parallel(self.weight, 0)

    def reset_parameters(self) -> None:
        """``nn.Embedding``'s initialisation (N(0, 1)) of the full table; keep this rank's rows."""
        full = torch.empty(self.num_embeddings, self.embedding_dim, device=self.weight.device,
                           dtype=self.weight.dtype)
        nn.init.normal_(full)
        if self.padding_idx is not None:
            full[self.padding_idx] = 0
        self.load_full(full)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        self.weight.copy_(weight[self.vocab_start:self.vocab_end])

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: Group) -> VocabParallelEmbedding:
        if embedding.max_norm is not None or embedding.sparse or embedding.scale_grad_by_freq:
            raise ValueError("VocabParallelEmbedding supports neither max_norm, sparse nor scale_grad_by_freq")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group,
                    padding_idx=embedding.padding_idx, device="meta", dtype=embedding.weight.dtype)
        layer.to_empty(device=embedding.weight.device)
        layer._mark_params()
        layer.load_full(embedding.weight)
        layer.weight.requires_grad_(embedding.weight.requires_grad)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        padding = self.padding_idx
        local_padding = padding - self.vocab_start if padding is not None and self.vocab_start <= padding < self.vocab_end else None
        out = F.embedding(local_ids, self.weight, local_padding)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.group.size}"
