"""Weight refresh: the trainer's weights into the rollout engine's own model, without disk.

After an optimizer step the trainer's weights sit in its layout: tensor- and pipeline-parallel
shards, FSDP2's row shards, copies on every data-parallel rank (with or without the distributed
optimizer). The engine holds every layer at its own tensor-parallel size. A refresh makes each
weight whole by its mega (Megatron-Core) name, one tensor at a time, and each engine rank keeps
its shard of it.

Both ends are the checkpoint's code, so a refresh places every element where a save at the
training layout and a load at the engine's would: :func:`~mega.core.checkpoint.state.model_entries`
gives the pieces this rank holds with their offsets in the global tensor (what a save writes),
and :func:`~mega.core.checkpoint.load_model_weights` fills a model built at any tensor-parallel
size from a source of global tensors (what the inference loader does with a Hugging Face
directory). The middle is this module's: for every distinct piece one rank (the lowest of those
holding that same box) writes it into a zeroed global tensor, and one all-reduce (a sum) over
the world gives every rank the whole tensor. Each element has exactly one writer, so the sum is
exact in any dtype. The plan (which rank writes which box) is made once, from every rank's boxes,
and checked: the distinct boxes of a tensor must tile it.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn

from mega.core.checkpoint import load_model_weights
from mega.core.checkpoint.state import MODEL, model_entries, settle
from mega.core.parallel import ParallelGroups

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the global tensor


def _boxes(entries) -> dict[str, tuple[tuple[int, ...], torch.dtype, list[Box]]]:
    return {key[len(MODEL):]: (entry.global_shape, entry.dtype,
                               [(tuple(p.offsets), tuple(p.data.shape)) for p in entry.pieces])
            for key, entry in entries.entries.items() if key.startswith(MODEL)}


def _overlap(a: Box, b: Box) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1], strict=True))


def writers(every_rank: list[dict]) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], dict[str, dict[Box, int]]]:
    """From every rank's ``name -> (global shape, dtype, boxes)``: each tensor's shape and dtype,
    and for each distinct box the rank that writes it (the lowest holding it). Raises when the
    ranks disagree on a tensor or its distinct boxes do not tile it exactly."""
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    owners: dict[str, dict[Box, int]] = {}
    for rank, held in enumerate(every_rank):
        for name, (shape, dtype, boxes) in held.items():
            if shapes.setdefault(name, (shape, dtype)) != (shape, dtype):
                raise ValueError(f"weight refresh: ranks disagree on {name}: {shapes[name]} and {(shape, dtype)}")
            for box in boxes:
                owners.setdefault(name, {}).setdefault(box, rank)
    for name, boxes in owners.items():
        distinct = list(boxes)
        covered = sum(math.prod(sizes) for _, sizes in distinct)
        overlapping = any(_overlap(a, b) for i, a in enumerate(distinct) for b in distinct[i + 1:])
        if overlapping or covered != math.prod(shapes[name][0]):
            raise ValueError(f"weight refresh: the trainer's pieces of {name} do not tile its global shape "
                             f"{list(shapes[name][0])} ({len(distinct)} distinct pieces)")
    return shapes, owners


class WeightSync:
    """Copies the weights of ``chunks`` (the trainer's model chunks on this rank, laid out over
    ``train_groups``) into ``engine_model`` (built whole over ``engine_groups``' tensor group).
    Collective: every rank of the world constructs it and calls :meth:`refresh` together."""

    def __init__(self, chunks: list[nn.Module], train_groups: ParallelGroups, engine_model: nn.Module,
                 engine_groups: ParallelGroups, optimizer=None):
        self.chunks, self.tp, self.optimizer = chunks, train_groups.tp, optimizer
        self.engine_model, self.engine_groups = engine_model, engine_groups
        self.device = train_groups.device
        held = _boxes(self._entries())
        every_rank = [held]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every_rank = [None] * dist.get_world_size()
            dist.all_gather_object(every_rank, held)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.shapes, owners = writers(every_rank)
        engine_names = {key[len(MODEL):] for key in model_entries([engine_model], engine_groups.tp).entries
                        if key.startswith(MODEL)}
        extra = sorted(set(self.shapes) - engine_names)
        if extra:  # the engine would generate from weights the trainer does not use
            raise ValueError(f"weight refresh: the trainer has {len(extra)} tensor(s) the engine's model has not "
                             f"({', '.join(extra[:3])}...; LoRA adapters?): run the engine at the training layout, "
                             "where it generates from the trainer's own module")
        self.written = {name: {box for box, rank in boxes.items() if rank == self.rank} for name, boxes in owners.items()}

    def _entries(self):
        settle(self.chunks, self.optimizer)  # parameter all-gathers finished, FSDP units resharded
        return model_entries(self.chunks, self.tp)

    @torch.no_grad()
    def full_tensor(self, name: str, entries) -> torch.Tensor:
        """The whole tensor ``name`` on every rank (collective: every rank asks for the same names
        in the same order)."""
        if name not in self.shapes:
            raise ValueError(f"weight refresh: the engine's model has {name}, which the trainer's has not")
        shape, dtype = self.shapes[name]
        whole = torch.zeros(shape, dtype=dtype, device=self.device)
        entry = entries.entries.get(MODEL + name)
        wanted = set(self.written[name])
        for piece in entry.pieces if entry is not None else []:
            box = (tuple(piece.offsets), tuple(piece.data.shape))
            if box in wanted:
                wanted.discard(box)  # a box held twice on this rank (a tied copy) is written once
                region = whole
                for dim, (offset, size) in enumerate(zip(*box, strict=True)):
                    region = region.narrow(dim, offset, size)
                region.copy_(piece.data)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(whole)
        return whole

    def refresh(self) -> float:
        """Copy the trainer's current weights into the engine's model; the seconds it took."""
        start = time.perf_counter()
        entries = self._entries()
        load_model_weights(_Gathered(self, entries), [self.engine_model], self.engine_groups)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start


class _Gathered:
    """The trainer's weights as a source of global tensors, gathered as they are asked for."""

    def __init__(self, sync: WeightSync, entries):
        self.sync, self.entries = sync, entries

    def get(self, name: str) -> torch.Tensor:
        return self.sync.full_tensor(name, self.entries)
