"""Is a checkpoint whole? Every tensor it was meant to hold is in its tensor index, at its global
shape, and the pieces the ranks wrote cover every element of it.

A save records what it means to write in ``mega_checkpoint.json`` (``tensors``: key -> global
shape), gathered from every rank and named from the model's parameters (each trainable one
brings its optimizer state), not from the pieces written: a rank that left something out cannot
leave it out of the record too. The save then checks the index DCP wrote against that record
before the checkpoint is published; ``mega checkpoint verify`` and every load check it again. A
checkpoint saved before the record existed is checked against what its index and optimizer
description imply: every saved parameter its model trains has each of the optimizer's state
tensors.

Checksums say a file is as it was written; this says that what was written is everything.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch.distributed as dist

from mega.core.checkpoint.metadata import CheckpointError, CheckpointMetadata
from mega.core.checkpoint.sharded_io import IncompleteSave, read_index
from mega.core.checkpoint.state import MODEL, OPTIMIZER, named_parameters
from mega.core.checkpoint.validate import name_examples

Manifest = dict[str, list[int]]  # checkpoint key -> global shape


def union_over_ranks(part: Manifest, process_group=None) -> Manifest | None:
    """The union of every rank's ``part`` on the group's first rank (None on the others)."""
    if process_group is None or not dist.is_initialized():
        return dict(part)
    parts = [None] * dist.get_world_size(process_group) if dist.get_rank(process_group) == 0 else None
    dist.gather_object(part, parts, group=process_group, group_dst=0)
    if parts is None:
        return None
    union: Manifest = {}
    for rank_part in parts:
        union.update(rank_part)
    return union


def expected_tensors(metadata: CheckpointMetadata, index: dict, optimizer: bool = True) -> Manifest:
    """What ``metadata`` says the checkpoint holds (its optimizer state only with ``optimizer``):
    its record, or for a checkpoint saved before records were kept, every saved model tensor and
    each of the optimizer's state tensors of those the model trains (frozen ones, as DeepSeek's
    expert bias, told by the family's model)."""
    if metadata.tensors is not None:
        return {key: shape for key, shape in metadata.tensors.items() if optimizer or not key.startswith(OPTIMIZER)}
    expected = {key: list(md.size) for key, md in index.items() if not key.startswith(OPTIMIZER)}
    frozen = _frozen_parameters(metadata) if optimizer and metadata.optimizer is not None else None
    if frozen is not None:
        for key, md in index.items():
            if key.startswith(MODEL) and key[len(MODEL):] not in frozen:
                for state_key in metadata.optimizer["state_keys"]:
                    expected[f"{OPTIMIZER}{key[len(MODEL):]}.{state_key}"] = list(md.size)
    return expected


def _frozen_parameters(metadata: CheckpointMetadata) -> set[str] | None:
    """Names of the parameters the saved model does not train, from its family's whole model built
    on the meta device (nothing allocated); None when its family is not installed here."""
    # Start-up cost: only a checkpoint without a tensor record (saved before it existed) builds a model.
    import torch

    from mega.core.kernels import Kernels
    from mega.core.parallel.config import ParallelConfig
    from mega.core.plugins import get_plugins

    try:
        family = get_plugins().models.get(metadata.model_family)
        config = family.config_class(**metadata.model_config)
        with torch.device("meta"):
            model = family.build(config, family.whole_model(config), kernels=Kernels(), parallel=ParallelConfig())
    except Exception:  # a family not installed here, or a config it no longer reads: check the tensors alone
        return None
    return {name for name, param in named_parameters([model])[0].items() if not param.requires_grad}


def incomplete(expected: Manifest, index: dict) -> list[str]:
    """What is wrong with ``index`` (DCP's tensor index) against ``expected``, one line each:
    tensors missing, at another shape, or with elements no piece covers."""
    missing = {key for key in expected if key not in index}
    problems = [f"lacks {name_examples(missing)}"] if missing else []
    for key, shape in sorted(expected.items()):
        if key not in index:
            continue
        saved = list(index[key].size)
        if saved != list(shape):
            problems.append(f"{key} has shape {saved}, recorded as {list(shape)}")
            continue
        covered = _covered_elements(index[key].chunks, saved)
        if covered != math.prod(saved):
            problems.append(f"{key}: its pieces cover {covered} of its {math.prod(saved)} elements")
    return problems


def check_complete(path: Path, metadata: CheckpointMetadata, index: dict, *, optimizer: bool = True,
                   only: set[str] | None = None) -> None:
    """Raise :class:`CheckpointError` naming what ``path`` lacks of what it records: with
    ``optimizer`` its optimizer state too (a load that reads it); ``only``: just these keys."""
    expected = expected_tensors(metadata, index, optimizer)
    if only is not None:
        expected = {key: shape for key, shape in expected.items() if key in only}
    problems = incomplete(expected, index)
    if problems:
        raise CheckpointError(f"checkpoint {path} is incomplete: it " + "; ".join(problems))


def confirm_written(staging: Path, expected: Manifest | None, process_group=None) -> None:
    """After every rank wrote ``staging``: its first rank checks the index against ``expected``
    (that rank's record of the save) and every rank raises the same error if anything is missing,
    so the save fails before it is published."""
    try:
        problems = None if expected is None else incomplete(expected, read_index(staging))
    except Exception as error:  # every rank waits for the verdict: an unreadable index is one too
        problems = [f"has an unreadable tensor index ({type(error).__name__}: {error})"]
    if process_group is not None and dist.is_initialized():
        verdict = [problems]
        dist.broadcast_object_list(verdict, group=process_group, group_src=0)
        problems = verdict[0]
    if problems:
        raise IncompleteSave(staging, problems)


def _covered_elements(chunks, shape: list[int]) -> int:
    """Elements of the distinct in-bounds pieces (DCP writes each distinct piece once, and refuses
    to save pieces that overlap, so their sizes add up to the whole only if they cover it)."""
    distinct = {(tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in chunks}
    total = 0
    for offsets, sizes in distinct:
        if all(0 <= o and o + s <= n for o, s, n in zip(offsets, sizes, shape, strict=True)):
            total += math.prod(sizes)
    return total
