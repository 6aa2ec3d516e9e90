"""``forward_backward``: one global batch's micro-batches through the pipeline, forward and back.

The schedule is the table of :func:`~mega.core.pipeline.schedule_table.schedule_table`: no
pipelining for ``pp == 1`` (gradient accumulation), 1F1B for one model chunk per rank,
interleaved 1F1B for several, the zero-bubble schedules (``zb-h1``, ``zbv``, ``dualpipev``:
:mod:`mega.core.pipeline.zero_bubble`). This module only executes it: before
each step of the table it runs that step's exchange of tensors with the neighbouring stages, then
the step's forward and backward passes. Where the table splits backwards into B and W, each
forward runs inside :func:`~mega.core.parallel.weight_grad_split.deferring_weight_grads`, so its
B leaves the layers' weight-gradient products to its W; but where the first stage runs a
micro-batch's W right after its B (always under ZB-H1), that B computes the weight gradients
itself, as 1F1B's backward does, so the first rank holds 1F1B's memory (see :func:`~mega.core.pipeline.schedule_table.whole_backwards`).

As in Megatron, each micro-batch's loss is divided by the number of micro-batches before its
backward, so the accumulated gradients are those of the mean loss over the global batch; and
the gradients of data-parallel replicas are reduced once, after the last backward (with
``overlap_grad_reduce``, bucket by bucket as each bucket's last gradient, from a B or a W, is in).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from mega.core.parallel import ParallelGroups
from mega.core.parallel.weight_grad_split import deferring_weight_grads, run_weight_grads
from mega.core.pipeline.messages import consumed, crossing, exchanges, produced
from mega.core.pipeline.p2p import PipelineLinks
from mega.core.pipeline.schedule_table import (
    FORWARD,
    WEIGHT,
    Action,
    ScheduleTable,
    schedule_table,
    whole_backwards,
)
from mega.core.pipeline.tensor_spec import TensorSpec
from mega.core.pipeline.tied import sum_tied_grads, tied_parameters
from mega.core.plugins import Events

# The name of the one tensor that crosses when chunks map a tensor to a tensor.
TENSOR = "tensor"


class GradSync(Protocol):
    """A data-parallel wrapper's gradient synchronisation (Megatron's no_sync / finalize)."""

    def no_sync(self) -> contextlib.AbstractContextManager: ...

    def finish_grad_sync(self) -> None: ...


def forward_backward(
    chunks: nn.Module | Sequence[nn.Module],
    data: Iterable | None,
    num_microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    groups: ParallelGroups,
    *,
    boundary: Callable[[int], Mapping[str, TensorSpec]] | None = None,
    tensor_shape: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    reads_batch: Sequence[bool] | None = None,
    grad_sync: GradSync | Sequence[GradSync | None] | None = None,
    events: Events | None = None,
    forward_only: bool = False,
    schedule: str = "1f1b",
) -> list[torch.Tensor]:
    """Run ``num_microbatches`` micro-batches forward (and backward); return the losses.

    ``chunks``: this rank's model chunks (one module, or ``vpp`` of them for the interleaved
    schedule, e.g. from :func:`~mega.core.pipeline.partition.pipeline_chunks`).

    ``data`` yields micro-batches ``(inputs, targets)``; the first stage is called with
    ``inputs``, the last passes its output and ``targets`` to ``loss_fn(output, targets)``, which
    returns the micro-batch's mean loss. Ranks whose chunks read no micro-batch may pass None.

    What crosses stages: ``boundary(stage)`` names the tensors virtual stage ``stage`` sends on
    (``{name: TensorSpec}``); chunks then take and return dicts, and a chunk that ``reads_batch``
    (one flag per chunk; default: the first and the last stage) gets the micro-batch's ``inputs``
    (a dict) merged under what crossed in. Or one tensor of ``tensor_shape`` and ``dtype``
    crosses, and chunks map a tensor to a tensor.

    ``schedule``: ``"1f1b"`` (interleaved with several chunks), ``"zb-h1"`` (interleaved zero
    bubble with several), ``"zbv"`` or ``"dualpipev"`` (two chunks in a V: the chunks are then
    virtual stages ``rank`` and ``2 pp - 1 - rank``, e.g. from ``pipeline_chunks(..., placement="v")``).

    ``grad_sync``: the data-parallel wrapper, or one per chunk. Every backward (and W) but the
    last one of its chunks runs inside its ``no_sync()``; ``finish_grad_sync()`` is called at the end,
    then the gradients of weights tied across stages are summed.

    Returns the un-normalised per-micro-batch losses (detached) on the rank of the last stage
    (the first rank in a V), else ``[]``.
    Gradients accumulate (in ``.grad``, or the wrapper's ``main_grad``); zeroing them before the
    step is the caller's job.
    """
    single = isinstance(chunks, nn.Module) and not isinstance(chunks, nn.ModuleList)
    chunks = [chunks] if single else list(chunks)
    expected = groups.config.vpp or 1
    if len(chunks) != expected:
        raise ValueError(
            f"got {len(chunks)} model chunks, but the parallel config has vpp = {groups.config.vpp} "
            f"(so {expected} chunk{'s' if expected > 1 else ''} per pipeline rank)"
        )
    if boundary is None and tensor_shape is not None:
        spec = {TENSOR: TensorSpec(tuple(tensor_shape), dtype)}
        boundary = lambda stage: spec  # noqa: E731
    if groups.pp.size > 1 and boundary is None:
        raise ValueError(
            f"pp = {groups.pp.size} needs boundary (or tensor_shape): the shapes of the tensors "
            f"sent between stages, e.g. [sequence, micro_batch, hidden]"
        )
    table = schedule_table(groups.pp.size, num_microbatches, len(chunks), forward_only, schedule)
    events = events if events is not None else Events()
    links = PipelineLinks(groups, boundary, events, table.rank_and_chunk) if groups.pp.size > 1 else None
    if reads_batch is None:
        last = table.num_stages - 1
        reads_batch = [table.stage(groups.pp.rank, chunk) in (0, last) for chunk in range(len(chunks))]
    if table.splits_backward and not forward_only:
        _refuse_fsdp(chunks, schedule)
    run = _ScheduleRun(table, groups, chunks, data, loss_fn, links, grad_sync, events, forward_only, reads_batch)
    return run.execute()


def _refuse_fsdp(chunks: Sequence[nn.Module], schedule: str) -> None:
    """FSDP2 reduce-scatters a module's gradients from its post-backward hook: before W. (Its
    DTensor parameters exist only where torch.distributed.tensor was imported: no import here.)"""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and any(isinstance(p, dtensor.DTensor) for chunk in chunks for p in chunk.parameters()):
        raise ValueError(f"--pipeline-schedule {schedule} leaves weight gradients to a W step after the backward, "
                         f"but FSDP (--data-parallel-sharding-strategy optim_grads or optim_grads_params: DTensor "
                         f"parameters) reduce-scatters them at its end: use --pipeline-schedule 1f1b with FSDP")


class _ScheduleRun:
    """The state of one ``forward_backward`` call on one rank."""

    def __init__(self, table: ScheduleTable, groups, chunks, data, loss_fn, links, grad_sync, events,
                 forward_only, reads_batch):
        self.table = table
        self.rank = groups.pp.rank
        self.groups = groups
        self.chunks = chunks
        self.data = iter(data) if data is not None else None
        self.loss_fn = loss_fn
        self.links = links
        self.events = events
        self.forward_only = forward_only
        self.reads_batch = list(reads_batch)
        self.batches: dict[int, list] = {}  # micro-batch -> [(inputs, targets), forwards still to read it]
        self.fetched = 0
        self.saved: dict[tuple[int, int], tuple[dict | None, Any]] = {}  # (mb, chunk) -> (received, output)
        self.inbox: dict = {}  # Message -> received tensors by name
        self.outbox: dict = {}  # Message -> tensors by name to send at the next exchange
        self.losses: list[torch.Tensor] = []
        self.syncers = _per_chunk(grad_sync, len(chunks))
        # A wrapper syncs during the last backward through any chunk it covers (and during the
        # last W: a weight's gradient arrives in B or in W, and each only once outside no_sync).
        self.final_actions: dict[tuple[int, str], Action] = {}
        for action in table.actions[self.rank]:
            if action.kind != FORWARD and self.syncers[action.chunk] is not None:
                self.final_actions[(id(self.syncers[action.chunk]), action.kind)] = action
        self.deferred: dict[tuple[int, int], list] = {}  # (mb, chunk) -> weight-gradient products for its W
        self.splits_backward = table.splits_backward and not forward_only
        self.whole_backward = whole_backwards(table, self.rank) if self.splits_backward else set()
        # A rank that holds the first and the last stage (pp = 1) uses a tied word embedding for
        # the lookup and the output layer: its gradient stays whole in B.
        stages = {table.stage(self.rank, chunk) for chunk in range(len(chunks))}
        holds_both_ends = {0, table.num_stages - 1} <= stages
        self.keep_in_b = tied_parameters(chunks) if holds_both_ends else []

    def execute(self) -> list[torch.Tensor]:
        steps = self.table.steps[self.rank]
        plan = exchanges(self.table, self.rank)
        for step, exchange in zip(steps, plan[:-1], strict=True):
            self._exchange(exchange)
            for action in step:
                if action.kind == FORWARD:
                    self._forward(action)
                elif action.kind == WEIGHT:
                    self._weight_grads(action)
                else:
                    self._backward(action)
        self._exchange(plan[-1])
        if not self.forward_only:
            self._finish_grads()
        return self.losses

    def _exchange(self, exchange) -> None:
        if self.links is not None:
            self.inbox.update(self.links.exchange(exchange, self.outbox))

    def _forward(self, action: Action) -> None:
        stage = self.table.stage(self.rank, action.chunk)
        first, last = stage == 0, stage == self.table.num_stages - 1
        inputs = targets = None
        if self.reads_batch[action.chunk]:
            inputs, targets = self._microbatch(action.microbatch)
        received = None
        if first:
            x = inputs
        else:
            received = self.inbox.pop(consumed(self.table, self.rank, action))
            for tensor in received.values():
                if tensor.is_floating_point():
                    tensor.requires_grad_(not self.forward_only)
            if set(received) == {TENSOR}:
                x = received[TENSOR]
            else:
                x = {**inputs, **received} if isinstance(inputs, Mapping) else received
        self.events.hook.on_forward_start(microbatch=action.microbatch, chunk=action.chunk)
        deferring = contextlib.nullcontext()
        if self.splits_backward and (action.microbatch, action.chunk) not in self.whole_backward:
            deferring = deferring_weight_grads(self.deferred.setdefault((action.microbatch, action.chunk), []),
                                               self.keep_in_b)
        with torch.set_grad_enabled(not self.forward_only), self.events.forward_context(action.microbatch, action.chunk), \
                deferring:
            y = self.chunks[action.chunk](x)
            if last:
                loss = self.loss_fn(y, targets)
                self.losses.append(loss.detach())
                y = loss / self.table.num_microbatches
        if not last:
            y = y if isinstance(y, Mapping) else {TENSOR: y}
            self._send(produced(self.table, self.rank, action), {name: t.detach() for name, t in y.items()})
        if not self.forward_only:
            self.saved[(action.microbatch, action.chunk)] = (received, y)
        self.events.hook.on_forward_end(microbatch=action.microbatch, chunk=action.chunk)

    def _backward(self, action: Action) -> None:
        received, y = self.saved.pop((action.microbatch, action.chunk))
        incoming = consumed(self.table, self.rank, action)
        self.events.hook.on_backward_start(microbatch=action.microbatch, chunk=action.chunk)
        with self._sync_context(action):
            if incoming is None:  # the last stage: y is the loss
                torch.autograd.backward(y)
            else:
                grads = self.inbox.pop(incoming)
                pairs = [(y[name], grad) for name, grad in grads.items() if y[name].requires_grad]
                if pairs:
                    torch.autograd.backward([out for out, _ in pairs], grad_tensors=[grad for _, grad in pairs])
        outgoing = produced(self.table, self.rank, action)
        if outgoing is not None:
            self._send(outgoing, {name: t.grad if t.grad is not None else torch.zeros_like(t)
                                  for name, t in received.items() if t.is_floating_point()})
        self.events.hook.on_backward_end(microbatch=action.microbatch, chunk=action.chunk)

    def _send(self, message, tensors: dict) -> None:
        """To the next exchange, or straight to this rank's inbox where it holds both stages."""
        if crossing(self.table, self.rank, message) is None:
            self.inbox[message] = {name: tensor.clone() for name, tensor in tensors.items()}
        else:
            self.outbox[message] = tensors

    def _weight_grads(self, action: Action) -> None:
        """W: the weight-gradient products the micro-batch's B left for this chunk."""
        self.events.hook.on_weight_grad_start(microbatch=action.microbatch, chunk=action.chunk)
        with self._sync_context(action):
            run_weight_grads(self.deferred.pop((action.microbatch, action.chunk), []))
        self.events.hook.on_weight_grad_end(microbatch=action.microbatch, chunk=action.chunk)

    def _sync_context(self, action: Action):
        syncer = self.syncers[action.chunk]
        if syncer is None or self.final_actions[(id(syncer), action.kind)] == action:
            return contextlib.nullcontext()
        return syncer.no_sync()

    def _microbatch(self, microbatch: int) -> tuple[Any, Any]:
        """The micro-batch, read once however many of this rank's chunks read it."""
        if self.data is None:
            raise ValueError(f"pipeline rank {self.rank} has a stage that reads the micro-batches, but got no data")
        while self.fetched <= microbatch:
            try:
                inputs, targets = next(self.data)
            except StopIteration:
                raise ValueError(
                    f"the data iterator ran out after {self.fetched} micro-batches; "
                    f"num_microbatches is {self.table.num_microbatches}"
                ) from None
            self.batches[self.fetched] = [(inputs, targets), sum(self.reads_batch)]
            self.fetched += 1
        entry = self.batches[microbatch]
        entry[1] -= 1
        if entry[1] == 0:
            del self.batches[microbatch]
        return entry[0]

    def _finish_grads(self) -> None:
        self.events.hook.on_grad_sync_start()
        unique = {id(syncer): syncer for syncer in self.syncers if syncer is not None}
        for syncer in unique.values():
            syncer.finish_grad_sync()
        sum_tied_grads(self.chunks, self.groups)
        self.events.hook.on_grad_sync_end()


def _per_chunk(grad_sync, num_chunks: int) -> list:
    if isinstance(grad_sync, Sequence):
        if len(grad_sync) != num_chunks:
            raise ValueError(f"got {len(grad_sync)} grad_sync objects for {num_chunks} model chunks")
        return list(grad_sync)
    return [grad_sync] * num_chunks
