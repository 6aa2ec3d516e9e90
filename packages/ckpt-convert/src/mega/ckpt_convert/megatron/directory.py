"""Megatron-LM save directories: finding the checkpoint a path names and which format it is in.

::

    SAVE/latest_checkpointed_iteration.txt      "500" or "release"
    SAVE/iter_0000500/mp_rank_00/model_optim_rng.pt          legacy (--ckpt-format torch), pp = 1
    SAVE/iter_0000500/mp_rank_01_003/model_optim_rng.pt      legacy, tp rank 1 of pp stage 3
    SAVE/iter_0000500/mp_rank_01_003_002/model_optim_rng.pt  ... of expert-parallel rank 2
    SAVE/iter_0000500/mp_rank_01_002/model_optim_rng.pt      with pp = 1 and ep > 1: expert-parallel rank 2
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
CHECKPOINT_VERSION = 3.0  # what Megatron-LM's save_checkpoint records
# Megatron-LM appends the pipeline stage when pp > 1, then the expert-parallel rank when ep > 1: the
# args say which a lone 3-digit group is.
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")


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


def first_rank_file(directory: Path) -> Path:
    """The file of tensor rank 0, pipeline stage 0 (expert rank 0), which holds the args."""
    file = directory / min(entry.name for entry in directory.iterdir() if _RANK_DIR.fullmatch(entry.name)) / RANK_FILE
    if not file.is_file():
        raise ConversionError(f"{file} is missing")
    return file


def last_rank_file(directory: Path) -> Path:
    """The file of tensor rank 0 on the last pipeline stage (the last expert rank), which holds the heads."""
    names = [entry.name for entry in directory.iterdir() if _RANK_DIR.fullmatch(entry.name)]
    file = directory / max(name for name in names if name.startswith("mp_rank_00")) / RANK_FILE
    if not file.is_file():
        raise ConversionError(f"{file} is missing")
    return file


def rank_files(directory: Path, pp: int, ep: int) -> dict[tuple[int, int, int], Path]:
    """(tp rank, pp stage, ep rank) -> model_optim_rng.pt of a legacy checkpoint saved at pipeline
    size ``pp`` and expert-parallel size ``ep``, checked to be a full grid."""
    files = {}
    for entry in directory.iterdir():
        match = _RANK_DIR.fullmatch(entry.name)
        if match:
            groups = [int(group) for group in match.groups()[1:] if group is not None]
            if len(groups) != (pp > 1) + (ep > 1):
                raise ConversionError(f"{entry}: a rank directory of a run at pipeline size {pp} and expert-parallel "
                                      f"size {ep} (the args) is named mp_rank_TT{'_PPP' * (pp > 1)}{'_EEE' * (ep > 1)}")
            stage = groups.pop(0) if pp > 1 else 0
            files[int(match.group(1)), stage, groups[0] if ep > 1 else 0] = entry / RANK_FILE
    tp = max(rank for rank, _, _ in files) + 1
    for rank in range(tp):
        for stage in range(pp):
            for expert_rank in range(ep):
                if (rank, stage, expert_rank) not in files:
                    raise ConversionError(f"{directory} lacks the directory of tensor rank {rank}, pipeline stage "
                                          f"{stage}, expert rank {expert_rank} (it has {len(files)} of "
                                          f"{tp} x {pp} x {ep})")
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
