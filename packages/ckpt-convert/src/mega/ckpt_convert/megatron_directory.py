"""Megatron-LM save directories: finding the checkpoint a path names and which format it is in.

::

    SAVE/latest_checkpointed_iteration.txt      "500" or "release"
    SAVE/iter_0000500/mp_rank_00/model_optim_rng.pt          legacy (--ckpt-format torch), pp = 1
    SAVE/iter_0000500/mp_rank_01_003/model_optim_rng.pt      legacy, tp rank 1 of pp stage 3
    SAVE/iter_0000500/{.metadata, __0_0.distcp, common.pt, metadata.json}   torch_dist
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from mega.ckpt_convert.errors import ConversionError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
DIST_CONFIG = "metadata.json"  # megatron-core's dist_checkpointing config
COMMON_FILE = "common.pt"
LEGACY, TORCH_DIST = "legacy", "torch_dist"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")


@dataclass(frozen=True)
class MegatronCheckpoint:
    directory: Path  # iter_NNNNNNN or release
    kind: str  # LEGACY or TORCH_DIST


def iteration_dir_name(iteration: int | None) -> str:
    return "release" if iteration is None else f"iter_{iteration:07d}"


def _kind(directory: Path) -> str | None:
    if (directory / DIST_CONFIG).is_file():
        return TORCH_DIST
    if any(_RANK_DIR.fullmatch(entry.name) for entry in directory.iterdir() if entry.is_dir()):
        return LEGACY
    return None


def find(path: Path) -> MegatronCheckpoint | None:
    """The Megatron-LM checkpoint ``path`` names (a save directory through its tracker, or one
    ``iter_*``/``release`` directory); None when ``path`` is no Megatron-LM directory."""
    if not path.is_dir():
        return None
    tracker = path / TRACKER_FILE
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text != "release" and not text.isdigit():
            return None
        directory = path / iteration_dir_name(None if text == "release" else int(text))
        if not directory.is_dir():
            return None
    else:
        directory = path
    kind = _kind(directory)
    return MegatronCheckpoint(directory, kind) if kind else None


def checkpoint(path: Path) -> MegatronCheckpoint:
    found = find(path)
    if found is None:
        tracker = path / TRACKER_FILE
        if tracker.is_file():
            raise ConversionError(f"{tracker} names {tracker.read_text().strip()!r}, which is no Megatron-LM "
                                  "checkpoint directory beside it")
        raise ConversionError(f"{path} is not a Megatron-LM checkpoint: it has neither {TRACKER_FILE}, "
                              f"mp_rank_* directories nor {DIST_CONFIG}")
    return found


def rank_files(directory: Path) -> dict[tuple[int, int], Path]:
    """(tp rank, pp stage) -> model_optim_rng.pt of a legacy checkpoint, checked to be a full grid."""
    files = {}
    for entry in directory.iterdir():
        match = _RANK_DIR.fullmatch(entry.name)
        if match:
            files[int(match.group(1)), int(match.group(2) or 0)] = entry / RANK_FILE
    tp = max(rank for rank, _ in files) + 1
    pp = max(stage for _, stage in files) + 1
    for rank in range(tp):
        for stage in range(pp):
            if (rank, stage) not in files:
                raise ConversionError(f"{directory} lacks the directory of tensor rank {rank}, pipeline stage "
                                      f"{stage} (it has {len(files)} of {tp} x {pp})")
    for file in files.values():
        if not file.is_file():
            raise ConversionError(f"{file} is missing")
    return files


def rank_dir_name(rank: int, stage: int, pp: int) -> str:
    return f"mp_rank_{rank:02d}" if pp == 1 else f"mp_rank_{rank:02d}_{stage:03d}"


def read_dist_config(directory: Path) -> dict:
    path = directory / DIST_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConversionError(f"{path} cannot be read: {error}") from None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if backend != TORCH_DIST:
        raise ConversionError(f"{path}: sharded_backend {backend!r}; mega reads torch_dist checkpoints "
                              "(re-save zarr ones with --ckpt-format torch_dist)")
    return config
