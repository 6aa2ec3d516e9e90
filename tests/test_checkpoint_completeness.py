"""A checkpoint holds every tensor it records, or nothing is published; verify and loads name what
one lacks (issue 47).

Runs on the CPU: one process, and a world of two gloo ranks (:mod:`mega.testing.distributed`).

A save is made to miss state the way a broken save would: the entries a rank offers lose some
keys or some pieces (``Entries.add`` patched). Then:

* the save fails naming the missing tensors, on every rank, before anything is published: no new
  checkpoint directory, no staging directory left, the tracker still names the previous one;
* with the save-time check switched off too (what older mega published), ``mega checkpoint
  verify`` calls the checkpoint damaged and ``--load`` refuses it, naming the missing tensors and
  the tensor whose pieces do not cover it; also for a checkpoint without the record of what it
  holds (saved by an older mega), from what its index and optimizer description imply.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from mega.core.checkpoint import CheckpointError, completeness, state
from mega.core.checkpoint.directory import STAGING_PREFIX, TRACKER_FILE
from mega.core.checkpoint.metadata import METADATA_FILE, CheckpointMetadata
from mega.core.checkpoint.sharded_io import ShardedEntry, read_index
from mega.core.parallel.pieces import Piece
from mega.train.testing.training_runs import train_losses

TINY = ["--mock-data", "--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "32", "--seq-length", "16",
        "--vocab-size", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-iters", "0",
        "--log-interval", "1000", "--lr", "1e-3", "--seed", "3"]
LOST = "optimizer.decoder.layers.1."  # the state a broken save leaves out
HALVED = "model.decoder.final_layernorm.weight"  # written only in part


def lossy_add(original, lose: str = LOST, halve: str | None = HALVED):
    """``Entries.add`` that drops the keys starting with ``lose`` and keeps only the first half of ``halve``."""

    def add(self, key, tensor, *args, **kwargs):
        if key.startswith(lose):
            return
        original(self, key, tensor, *args, **kwargs)
        if key == halve:
            entry = self.entries[key]
            piece = entry.pieces[0]
            half = Piece(piece.data[:piece.data.shape[0] // 2], piece.offsets)
            self.entries[key] = ShardedEntry(entry.global_shape, entry.dtype, [half])

    return add


def saved_names(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if not p.name.startswith(".mega-save"))


def test_a_save_that_would_miss_state_publishes_nothing(tmp_path, monkeypatch):
    save_dir = tmp_path / "ckpt"
    train_losses(TINY + ["--train-iters", "2", "--save", str(save_dir)])
    monkeypatch.setattr(state.Entries, "add", lossy_add(state.Entries.add))
    with pytest.raises(CheckpointError, match=r"missed state.*not published.*lacks optimizer\.decoder\.layers\.1\.") as error:
        train_losses(TINY + ["--train-iters", "4", "--load", str(save_dir), "--save", str(save_dir)])
    assert f"{HALVED}: its pieces cover 16 of its 32 elements" in str(error.value)
    assert saved_names(save_dir) == ["iter_0000002", TRACKER_FILE]
    assert (save_dir / TRACKER_FILE).read_text().strip() == "2"


def test_verify_and_load_name_what_a_checkpoint_lacks(tmp_path, monkeypatch):
    save_dir = tmp_path / "ckpt"
    with monkeypatch.context() as patched:  # the save of an older mega: nothing checked
        patched.setattr(state.Entries, "add", lossy_add(state.Entries.add))
        patched.setattr(completeness, "incomplete", lambda expected, index: [])
        train_losses(TINY + ["--train-iters", "2", "--save", str(save_dir)])
    checkpoint = save_dir / "iter_0000002"

    result = subprocess.run([sys.executable, "-m", "mega.core.cli.main", "checkpoint", "verify", str(save_dir)],
                            capture_output=True, text=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"DAMAGED  {checkpoint}: checkpoint {checkpoint} is incomplete: it lacks {LOST}" in result.stdout
    assert f"{HALVED}: its pieces cover 16 of its 32 elements" in result.stdout
    with pytest.raises(CheckpointError, match=rf"{checkpoint} is incomplete: it lacks optimizer\.decoder\.layers\.1\."):
        train_losses(TINY + ["--train-iters", "4", "--load", str(save_dir)])
    # Weights only: the optimizer state is not read, but the weights must be whole.
    with pytest.raises(CheckpointError, match=rf"is incomplete: it {HALVED}: its pieces cover 16 of its 32"):
        train_losses(TINY + ["--train-iters", "4", "--load", str(save_dir), "--no-load-optim"])

    # Saved before checkpoints recorded their tensors: what the index and optimizer imply.
    metadata_file = checkpoint / METADATA_FILE
    metadata = json.loads(metadata_file.read_text())
    metadata["tensors"] = None
    metadata_file.write_text(json.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"is incomplete: it lacks optimizer\.decoder\.layers\.1\."):
        completeness.check_complete(checkpoint, CheckpointMetadata.read(checkpoint), read_index(checkpoint))


def _dp2_save_missing_rank_1_pieces(save_dir: str) -> str:
    """ZeRO-1 at dp2 saves at step 2, then at step 3 rank 1 offers none of its optimizer slices."""
    import torch.distributed as dist

    argv = TINY + ["--use-distributed-optimizer", "--save", save_dir]
    train_losses(argv + ["--train-iters", "2"])
    lose = "optimizer." if dist.get_rank() == 1 else "nothing"
    with mock.patch.object(state.Entries, "add", lossy_add(state.Entries.add, lose=lose, halve=None)):
        try:
            train_losses(argv + ["--train-iters", "3", "--load", save_dir])
        except CheckpointError as error:
            return str(error)
    return "saved"


def test_every_rank_refuses_a_save_one_rank_left_pieces_out_of(worlds, tmp_path):
    save_dir = tmp_path / "ckpt"
    errors = worlds.run(2, _dp2_save_missing_rank_1_pieces, str(save_dir))
    assert errors[0] == errors[1], "both ranks fail the same way"
    assert "missed state, so it was not published" in errors[0] and "its pieces cover" in errors[0], errors[0]
    assert saved_names(save_dir) == ["iter_0000002", TRACKER_FILE]
    assert not any(p.name.startswith(STAGING_PREFIX) for p in save_dir.iterdir())
    assert (save_dir / TRACKER_FILE).read_text().strip() == "2"
