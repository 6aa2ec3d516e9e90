"""Disk space and checkpoints: a warning before a save that may not fit, one clear error (and no
half-written directory filling the disk) when one did not.

A full disk surfaces from deep inside torch's zip writer as "RuntimeError: [enforce fail at
inline_container.cc] . unexpected pos 704 vs 598", many frames below an OSError(ENOSPC) that
was already forgotten. Here it becomes "no space left on device writing PATH (needed ~X GiB,
Y GiB free)", the staging directory is removed, and the previous checkpoint stays as it was.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import sys
from pathlib import Path

from mega.core.checkpoint.directory import saved_iterations
from mega.core.checkpoint.metadata import CheckpointError, CheckpointMetadata

# How a full disk (or quota) reads once DCP and torch's zip writer have wrapped it.
_OUT_OF_SPACE_TEXT = ("No space left on device", "Disk quota exceeded", "unexpected pos")


def human_size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GiB"


def free_bytes(directory: Path) -> int:
    """Free bytes on the file system that holds ``directory`` (or its nearest existing parent)."""
    directory = Path(directory).absolute()
    while not directory.exists():
        directory = directory.parent
    return shutil.disk_usage(directory).free


def warn_if_short(save_dir: Path, needed: int) -> None:
    """Warn (on stderr) when ``save_dir``'s file system has less than ``needed`` bytes free."""
    free = free_bytes(save_dir)
    if free < needed:
        print(f"WARNING: {save_dir} has {human_size(free)} free; a checkpoint needs about {human_size(needed)}: this save "
              "will probably fail (the previous checkpoint is kept if it does)", file=sys.stderr, flush=True)


def is_out_of_space(error: BaseException) -> bool:
    """Whether ``error`` is a full disk or quota, however wrapped (DCP gathers every rank's failure
    into a CheckpointException, a BaseException, with the original ones in ``failures``)."""
    pending = [error]
    while pending:
        seen = pending.pop()
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        pending += [cause for cause in (seen.__cause__, seen.__context__) if cause is not None]
        pending += [failure[0] for failure in getattr(seen, "failures", {}).values()]
    return any(text in str(error) for text in _OUT_OF_SPACE_TEXT)


@contextlib.contextmanager
def removed_if_failed(staging: Path, needed: int):
    """Remove the half-written ``staging`` directory if the body fails; a full disk becomes one
    :class:`CheckpointError` naming the directory and the space needed and free."""
    try:
        yield
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(error, (KeyboardInterrupt, SystemExit)) and is_out_of_space(error):
            raise CheckpointError(
                f"no space left on device writing {staging} (needed ~{human_size(needed)}, {human_size(free_bytes(staging))} "
                "free once the partial checkpoint was removed); earlier checkpoints are kept") from None
        raise


def expected_bytes(save_dir: Path, entries: dict, model_parallel_size: int) -> int:
    """About how many bytes the next checkpoint in ``save_dir`` takes: the size of the newest one
    there, or else this rank's share of the tensors times the ranks that hold different shares."""
    for _, path in reversed(saved_iterations(save_dir)):
        try:
            return sum(CheckpointMetadata.read(path).files.values())
        except CheckpointError:
            continue
    return model_parallel_size * entries_bytes(entries)


def entries_bytes(entries: dict) -> int:
    """The bytes of the tensor pieces of ``entries`` (ShardedEntry values)."""
    return sum(_piece_bytes(piece, entry.dtype) for entry in entries.values() for piece in entry.pieces)


def _piece_bytes(piece, dtype) -> int:
    shape = piece.data.shape if hasattr(piece, "data") else piece[0].shape
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize
