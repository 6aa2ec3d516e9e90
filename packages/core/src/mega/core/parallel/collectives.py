"""Collectives over a :class:`~mega.core.parallel.groups.Group`, counted, and their autograd forms.

Two layers live here:

* Plain collectives (``all_reduce``, ``all_gather_into``, ``reduce_scatter_into``,
  ``all_to_all_single``) used by the data-parallel buffers and the optimizers. Each one is a
  no-op on a group of size 1 (a single process, or a dimension that is not split) or 0 (a rank
  outside the group, e.g. a middle pipeline stage and the embedding group), so the same code
  runs on one process and on any layout, and never falls through to the whole world.
* Autograd functions for tensor and sequence parallelism, Megatron's "regions": a function and
  its backward are a pair of collectives (``copy_to_tensor_parallel_region`` is the identity
  forward and an all-reduce backward; ``reduce_scatter_to_sequence_parallel_region`` is a
  reduce-scatter along the sequence forward and an all-gather backward; ...).

Counting: inside ``with CommCounter() as counts:`` every collective handed to a group of size > 1
is recorded per (kind, group name): calls, elements and bytes. Elements follow nccl-tests'
convention, the size of the whole buffer the collective works on: an all-gather of 4 shards of
``n`` elements counts ``4n``, a reduce-scatter of ``4n`` elements to shards of ``n`` counts ``4n``.
So a tensor-parallel layer's all-reduce of ``b*s*h`` and the sequence-parallel all-gather plus
reduce-scatter that replace it count the same ``b*s*h`` each. The backward of an autograd
collective reports to the counter active when the backward runs, or, if none is (GPU autograd
runs backward on its own threads), to the one that was active during the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mega.core.parallel.groups import Group

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------


@dataclass
class CommStats:
    calls: int = 0
    elements: int = 0
    bytes: int = 0


class CommCounter:
    """Records what is handed to each collective while it is active (a context manager).

    ``counts.calls("all_reduce", "tp")`` and ``counts.elements(...)`` read the totals; leaving out
    the group sums over groups. ``counts.stats`` maps ``(kind, group)`` to :class:`CommStats`.
    Counters nest: the innermost active one records.
    """

    def __init__(self) -> None:
        self.stats: dict[tuple[str, str], CommStats] = {}
        self._tokens: list = []

    def record(self, kind: str, group: Group, tensor: torch.Tensor) -> None:
        entry = self.stats.setdefault((kind, group.name), CommStats())
        entry.calls += 1
        entry.elements += tensor.numel()
        entry.bytes += tensor.numel() * tensor.element_size()

    def calls(self, kind: str, group: str | None = None) -> int:
        return sum(s.calls for (k, g), s in self.stats.items() if k == kind and group in (None, g))

    def elements(self, kind: str, group: str | None = None) -> int:
        return sum(s.elements for (k, g), s in self.stats.items() if k == kind and group in (None, g))

    def summary(self) -> dict[str, dict[str, int]]:
        """``{"all_reduce/tp": {"calls": 4, "elements": ..., "bytes": ...}, ...}``, for logs and JSON."""
        return {f"{k}/{g}": vars(s).copy() for (k, g), s in sorted(self.stats.items())}

    def __enter__(self) -> CommCounter:
        self._tokens.append(_active.set(self))
        return self

    def __exit__(self, *exc_info) -> None:
        _active.reset(self._tokens.pop())


_active: ContextVar[CommCounter | None] = ContextVar("mega_comm_counter", default=None)


def active_counter() -> CommCounter | None:
    return _active.get()


def _record(kind: str, group: Group, tensor: torch.Tensor, counter: CommCounter | None = None) -> None:
    counter = active_counter() or counter
    if counter is not None:
        counter.record(kind, group, tensor)


# --------------------------------------------------------------------------------------------
# Plain collectives (no autograd). Every one returns immediately on a group of size 1.
# --------------------------------------------------------------------------------------------


def all_reduce(tensor: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op: bool = False,
               counter: CommCounter | None = None):
    """In-place all-reduce of ``tensor``; returns the work handle when ``async_op``."""
    if group.size <= 1:
        return None
    _record("all_reduce", group, tensor, counter=counter)
    return dist.all_reduce(tensor, op=op, group=group.group, async_op=async_op)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: Group, async_op: bool = False,
                    counter: CommCounter | None = None):
    """Gather equal ``shard``s into ``output`` (``group.size`` times larger), in rank order along dim 0.

    ``shard`` may be the rank's own slice of ``output`` (in place, as NCCL allows).
    """
    if group.size <= 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard.view_as(output))
        return None
    _record("all_gather", group, output, counter=counter)
    return _all_gather_flat(output, shard, group=group.group, async_op=async_op)


def reduce_scatter_into(shard: torch.Tensor, tensor: torch.Tensor, group: Group, async_op: bool = False,
                        counter: CommCounter | None = None):
    """Sum ``tensor`` over the group and keep this rank's ``1/size`` of it (along dim 0) in ``shard``."""
    if group.size <= 1:
        if shard.data_ptr() != tensor.data_ptr():
            shard.copy_(tensor.view_as(shard))
        return None
    _record("reduce_scatter", group, tensor, counter=counter)
    return _reduce_scatter_flat(shard, tensor, group=group.group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, group: Group,
                      output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      counter: CommCounter | None = None) -> None:
    """Rank ``i`` sends its ``j``-th dim-0 slice of ``tensor`` to rank ``j`` (equal slices unless split)."""
    if group.size <= 1:
        output.copy_(tensor)
        return
    _record("all_to_all", group, tensor, counter=counter)
    dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group.group)


# --------------------------------------------------------------------------------------------
# Tensor-shaped helpers: split / gather / reduce-scatter along a dimension.
# --------------------------------------------------------------------------------------------


def _check_divisible(length: int, group: Group, dim: int, what: str) -> None:
    if length % group.size:
        raise ValueError(
            f"{what}: size {length} of dimension {dim} is not divisible by the "
            f"{group.name} group size {group.size}"
        )


def split_along(tensor: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's contiguous ``1/size`` slice of ``tensor`` along ``dim`` (no communication)."""
    if group.size <= 1:
        return tensor
    _check_divisible(tensor.shape[dim], group, dim, "split")
    return tensor.chunk(group.size, dim=dim)[group.rank].contiguous()


def gather_along(tensor: torch.Tensor, group: Group, dim: int, counter: CommCounter | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` in rank order."""
    if group.size <= 1:
        return tensor
    tensor = tensor.contiguous()
    output = tensor.new_empty((group.size * tensor.shape[0],) + tuple(tensor.shape[1:]))
    all_gather_into(output, tensor, group, counter=counter)
    if dim % tensor.dim() == 0:
        return output
    return torch.cat(output.chunk(group.size, dim=0), dim=dim)


def reduce_scatter_along_first(tensor: torch.Tensor, group: Group, counter: CommCounter | None = None) -> torch.Tensor:
    """Sum over the group, keep this rank's slice along dimension 0."""
    if group.size <= 1:
        return tensor
    _check_divisible(tensor.shape[0], group, 0, "reduce-scatter")
    tensor = tensor.contiguous()
    output = tensor.new_empty((tensor.shape[0] // group.size,) + tuple(tensor.shape[1:]))
    reduce_scatter_into(output, tensor, group, counter=counter)
    return output


def _all_reduced(tensor: torch.Tensor, group: Group, counter: CommCounter | None = None) -> torch.Tensor:
    if group.size <= 1:
        return tensor
    tensor = tensor.clone(memory_format=torch.contiguous_format)
    all_reduce(tensor, group, counter=counter)
    return tensor


# --------------------------------------------------------------------------------------------
# Autograd regions (Megatron's mappings). Forward and backward are each one collective.
# --------------------------------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.counter = group, active_counter()
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduced(grad, ctx.group, ctx.counter), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduced(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.counter = group, dim, active_counter()
        return split_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.group, ctx.dim, ctx.counter), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, reduce_scatter_grad):
        ctx.group, ctx.dim, ctx.counter = group, dim, active_counter()
        ctx.reduce_scatter_grad = reduce_scatter_grad
        return gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_scatter_grad:
            return reduce_scatter_along_first(grad, ctx.group, ctx.counter), None, None, None
        return split_along(grad, ctx.group, ctx.dim), None, None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.counter = group, active_counter()
        return reduce_scatter_along_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.group, 0, ctx.counter), None


def _all_to_all(x: torch.Tensor, group: Group, output_split_sizes, input_split_sizes,
                counter: CommCounter | None = None) -> torch.Tensor:
    x = x.contiguous()
    rows = sum(output_split_sizes) if output_split_sizes is not None else x.shape[0]
    output = x.new_empty((rows,) + tuple(x.shape[1:]))
    all_to_all_single(output, x, group, output_split_sizes, input_split_sizes, counter=counter)
    return output


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_split_sizes, input_split_sizes):
        ctx.group, ctx.counter = group, active_counter()
        ctx.splits = (output_split_sizes, input_split_sizes)
        return _all_to_all(x, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, grad):
        output_split_sizes, input_split_sizes = ctx.splits
        # The gradient travels back the way the tokens came: the split sizes swap roles.
        return _all_to_all(grad, ctx.group, input_split_sizes, output_split_sizes, ctx.counter), None, None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient (the input of a column-parallel layer)."""
    return _CopyToRegion.apply(x, group) if group.size > 1 else x


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce forward (sum partial outputs of a row-parallel layer); identity backward."""
    return _ReduceFromRegion.apply(x, group) if group.size > 1 else x


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the last dimension; the gradient is split again."""
    return _GatherFromRegion.apply(x, group, -1, False) if group.size > 1 else x


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the sequence (dim 0); all-gather of the gradient."""
    return _ScatterToRegion.apply(x, group, 0) if group.size > 1 else x


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather the sequence (dim 0).

    The gradient is reduce-scattered when the consumer is tensor-parallel (each rank holds a
    partial gradient of the full sequence, as in front of a column-parallel layer), else split.
    """
    if group.size <= 1:
        return x
    return _GatherFromRegion.apply(x, group, 0, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum partial outputs and keep this rank's slice of the sequence; all-gather of the gradient."""
    return _ReduceScatterToRegion.apply(x, group) if group.size > 1 else x


def all_to_all(x: torch.Tensor, group: Group, output_split_sizes: Sequence[int] | None = None,
               input_split_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Differentiable all-to-all along dim 0 (token dispatch for expert parallelism)."""
    if group.size <= 1:
        return x
    return _AllToAll.apply(x, group, output_split_sizes, input_split_sizes)
