"""A W&B run lands where the docs say (issue 53, item 8): with no ``--wandb-save-dir`` in
``--save/wandb`` itself (wandb.init(dir=D) writes under D/wandb, so the save directory is D).
CPU only, one process, WANDB_MODE=offline."""

from __future__ import annotations

import pytest

from mega.train.command import main

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "64", "--micro-batch-size", "2", "--train-iters", "2", "--mock-data", "--log-interval", "1",
        "--eval-iters", "0"]


def test_the_run_lands_in_save_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    save = tmp_path / "save"
    assert main(TINY + ["--wandb-project", "mega-test", "--save", str(save)]) == 0
    assert len(list((save / "wandb").glob("offline-run-*"))) == 1
    assert not (save / "wandb" / "wandb").exists()
