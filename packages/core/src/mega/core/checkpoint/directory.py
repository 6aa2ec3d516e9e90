"""The save directory: naming, the ``latest`` tracker, atomic publishing, pruning and checks.

::

    SAVE_DIR/
      latest_checkpointed_iteration.txt     "20" (or "release"), replaced atomically, last
      iter_0000010/  iter_0000020/          complete checkpoints
        .metadata  __0_0.distcp ...         torch.distributed.checkpoint index and shards
        rng/rank_00000.json ...             per-rank RNG states
        tokenizer/...                       the run's tokenizer files
        mega_checkpoint.json                written last, lists every other file, its size and checksum
      .tmp-iter_0000030/                    a save in progress (never loaded)
      .mega-save.lock                       held by the run that saves here (lock.py)

A checkpoint is written under ``.tmp-<name>``, synced, given its final name by ``rename`` and
only then named by the tracker; older ones are removed only after that. Whenever a process is
killed, the tracker names a complete checkpoint (or none exists yet).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mega.core.checkpoint.checksums import record_checksums, verify_checksums
from mega.core.checkpoint.lock import LOCK_FILE
from mega.core.checkpoint.metadata import (
    DCP_METADATA_FILE,
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
STAGING_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


def iteration_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def staging_path(save_dir: Path, name: str) -> Path:
    return save_dir / f"{STAGING_PREFIX}{name}"


def fsync_path(path: Path) -> None:
    """Flush a file's or directory's entry to disk (a rename is durable only once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, path)
    fsync_path(path.parent)


def remove_leftovers(save_dir: Path) -> None:
    """Delete what killed saves and prunes left behind (never a named checkpoint).

    A save killed while replacing a checkpoint of the same iteration leaves the old one whole under
    its trash name and nothing under its own: that one is put back first.
    """
    if not save_dir.is_dir():
        return
    for entry in save_dir.iterdir():
        if entry.name.startswith(TRASH_PREFIX) and _set_aside_whole(save_dir, entry.name[len(TRASH_PREFIX):]):
            os.replace(entry, save_dir / entry.name[len(TRASH_PREFIX):])
    for entry in save_dir.iterdir():
        if entry.name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(entry, ignore_errors=True)


def _set_aside_whole(save_dir: Path, name: str) -> Path | None:
    """The complete checkpoint ``name`` that :func:`publish` moved aside and could not replace."""
    aside = save_dir / f"{TRASH_PREFIX}{name}"
    if (save_dir / name).exists() or not aside.is_dir():
        return None
    try:
        verify(aside)
    except CheckpointError:
        return None  # a prune was deleting it: it was not wanted anyway
    return aside


def publish(save_dir: Path, name: str, metadata: CheckpointMetadata, tracker: str) -> Path:
    """Seal the staged checkpoint ``name``: list its files in the metadata, rename it into place,
    then point the tracker at it. Runs on one process after every rank has written its files."""
    staging = staging_path(save_dir, name)
    files = sorted(p for p in staging.rglob("*") if p.is_file())
    metadata.files = {str(p.relative_to(staging)): p.stat().st_size for p in files}
    record_checksums(staging, metadata)
    with open(staging / METADATA_FILE, "w") as stream:
        stream.write(metadata.to_json())
        stream.flush()
        os.fsync(stream.fileno())
    for directory in {p.parent for p in files} | {staging}:
        fsync_path(directory)
    final = save_dir / name
    if final.exists():  # saving the same iteration again: the old one goes only once replaced
        old = save_dir / f"{TRASH_PREFIX}{name}"
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)
    fsync_path(save_dir)
    write_file_atomically(save_dir / TRACKER_FILE, tracker + "\n")
    return final


def saved_iterations(save_dir: Path) -> list[tuple[int, Path]]:
    found = []
    for entry in save_dir.iterdir() if save_dir.is_dir() else ():
        if entry.is_dir() and entry.name.startswith("iter_") and entry.name[5:].isdigit():
            found.append((int(entry.name[5:]), entry))
    return sorted(found)


def prune(save_dir: Path, keep_last: int, keep: Path) -> None:
    """Remove all but the newest ``keep_last`` iteration checkpoints (never ``keep``)."""
    for _, path in saved_iterations(save_dir)[:-keep_last]:
        if path != keep:
            trash = save_dir / f"{TRASH_PREFIX}{path.name}"
            os.replace(path, trash)  # the checkpoint disappears at once, then its bytes
            shutil.rmtree(trash, ignore_errors=True)


# -- reading ---------------------------------------------------------------------------------
def read_tracker(save_dir: Path) -> str | None:
    path = save_dir / TRACKER_FILE
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if text != RELEASE and not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}; expected an iteration number or {RELEASE!r}")
    return text


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The complete checkpoint ``path`` names: itself, or the one its tracker names.

    Raises :class:`CheckpointError` for a missing, partial, damaged or foreign directory. Only
    sizes are checked (it is called for every few tensors read); a load begins with
    :func:`checkpoint_and_metadata`, which compares checksums.
    """
    return checkpoint_and_metadata(path, checksums=False)[0]


def read_metadata(path: str | os.PathLike) -> CheckpointMetadata:
    """The metadata of the (complete) checkpoint ``path`` names (sizes checked, not checksums)."""
    return checkpoint_and_metadata(path, checksums=False)[1]


def checkpoint_and_metadata(path: str | os.PathLike, checksums: bool = True) -> tuple[Path, CheckpointMetadata]:
    """:func:`resolve_checkpoint` and :func:`read_metadata` at once (the metadata read once).

    This is where a load starts, so it also compares every file with its checksum (reading the
    whole checkpoint once) unless ``checksums`` is False."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not (path / METADATA_FILE).exists():
        tracked = read_tracker(path)
        if tracked is None:
            raise CheckpointError(_not_a_checkpoint(path))
        name = RELEASE if tracked == RELEASE else iteration_name(int(tracked))
        path = _set_aside_whole(path, name) or path / name
        if not path.is_dir():
            raise CheckpointError(f"{path.parent / TRACKER_FILE} names {name}, which does not exist")
    return path, verify(path, checksums)


def find_checkpoint(save_dir: str | os.PathLike, checksums: bool = True) -> tuple[Path, CheckpointMetadata] | None:
    """Like :func:`checkpoint_and_metadata`, but None for a directory that holds no checkpoint yet
    (nothing at all, or only an interrupted first save): a run may load from where it saves."""
    save_dir = Path(save_dir)
    if not save_dir.exists() or not any(
        not entry.name.startswith((STAGING_PREFIX, TRASH_PREFIX)) and entry.name != LOCK_FILE
        for entry in save_dir.iterdir()
    ):
        return None
    return checkpoint_and_metadata(save_dir, checksums)


def verify(directory: Path, checksums: bool = False) -> CheckpointMetadata:
    """The metadata of a checkpoint directory whose files are all there at their sizes (and, with
    ``checksums``, with the contents they were saved with)."""
    metadata = CheckpointMetadata.read(directory)
    if DCP_METADATA_FILE not in metadata.files:
        raise CheckpointError(f"{directory} lists no tensor index ({DCP_METADATA_FILE}); it is damaged")
    for name, size in metadata.files.items():
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {directory} is incomplete: {name} is missing")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(f"checkpoint {directory} is damaged: {name} has {actual} bytes, "
                                  f"expected {size} (truncated or overwritten)")
    if checksums:
        verify_checksums(directory, metadata)
    return metadata


def _not_a_checkpoint(path: Path) -> str:
    names = {entry.name for entry in path.iterdir()}
    if any(name.startswith("iter_") for name in names) or "release" in names:
        legacy = any(path.glob("*/mp_rank_*/model_optim_rng.pt"))
        if legacy:
            return (f"{path} is a Megatron-LM checkpoint (legacy torch.save format), not a mega checkpoint; "
                    "mega does not unpickle it")
        return f"{path} has checkpoint directories but no {TRACKER_FILE}; give one of them to --load"
    if DCP_METADATA_FILE in names:
        return (f"{path} is a torch.distributed.checkpoint directory without {METADATA_FILE}: "
                "written by another tool, or a mega save that never finished")
    if "config.json" in names:
        return f"{path} is a Hugging Face model directory; convert it with `mega convert --from hf --to mega`"
    return f"{path} is not a mega checkpoint: it has neither {METADATA_FILE} nor {TRACKER_FILE}"
