"""Checkpoints survive crashes, and damaged or foreign directories fail with one clear message.

* ``mega train --save`` processes are killed with SIGKILL at random moments while they save
  every iteration (synchronously and with ``--async-save``); each time the next ``--load`` of the
  directory resumes from its newest complete checkpoint.
* A truncated shard, a missing metadata file, a missing tensor index, a Hugging Face directory,
  a Megatron-LM legacy checkpoint and a foreign torch.distributed.checkpoint directory each give
  an error that names the problem, from the API and from ``mega train`` (exit code 2).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mega.core.checkpoint import (
    CheckpointError,
    checkpoint_and_metadata,
    read_tensors,
    resolve_checkpoint,
    tensor_shapes,
)
from mega.core.checkpoint.directory import TRACKER_FILE, read_tracker
from mega.core.checkpoint.lock import LOCK_FILE, SaveDirLock
from mega.train.checkpoint.info_command import main as info_main
from mega.train.checkpoint.verify_command import main as verify_main
from mega.train.command import main as train_main

TINY = ["--mock-data", "--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "64", "--seq-length", "32",
        "--vocab-size", "256", "--micro-batch-size", "2", "--eval-iters", "0", "--log-interval", "1000", "--lr", "1e-3"]


def mega_train(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "mega.core.cli.main", "train", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_new_checkpoint(save_dir: Path, process: subprocess.Popen, previous: str | None,
                            timeout: float = 60.0) -> None:
    """Until the tracker names a checkpoint other than ``previous`` (the process is saving)."""
    deadline = time.monotonic() + timeout
    while (read_tracker(save_dir) if (save_dir / TRACKER_FILE).exists() else None) in (None, previous):
        if process.poll() is not None:
            raise AssertionError(f"training ended before its first checkpoint:\n{process.stdout.read()}")
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)


def test_sigkill_at_random_moments_keeps_a_loadable_checkpoint(tmp_path):
    save_dir = tmp_path / "ckpt"
    seed = random.randrange(1 << 30)
    chooser = random.Random(seed)
    argv = TINY + ["--train-iters", "100000", "--save", str(save_dir), "--load", str(save_dir),
                   "--save-interval", "1", "--keep-last", "2"]
    newest = 0
    for trial in range(4):  # two synchronous saves, two asynchronous
        previous = read_tracker(save_dir) if save_dir.exists() else None
        process = mega_train(argv + (["--async-save"] if trial % 2 else []))
        wait_for_new_checkpoint(save_dir, process, previous)
        time.sleep(chooser.uniform(0.05, 0.6))
        process.send_signal(signal.SIGKILL)
        process.wait()
        checkpoint = resolve_checkpoint(save_dir)  # raises if the tracker names anything incomplete
        iteration = int(read_tracker(save_dir))
        assert iteration >= newest, f"seed {seed}, trial {trial}: went back from {newest} to {iteration}"
        newest = iteration
        tensors = read_tensors(checkpoint, list(tensor_shapes(checkpoint)))
        assert all(torch.isfinite(t).all() for t in tensors.values())
    # A last, clean resume trains on from the newest checkpoint and exits normally.
    final = subprocess.run([sys.executable, "-m", "mega.core.cli.main", "train", *TINY,
                            "--train-iters", str(newest + 2), "--load", str(save_dir)],
                           capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert final.returncode == 0, final.stdout + final.stderr
    assert f"saved at iteration {newest}" in final.stdout


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    save_dir = tmp_path_factory.mktemp("saved") / "ckpt"
    assert train_main(TINY + ["--train-iters", "2", "--save", str(save_dir)]) == 0
    return save_dir


def load_error(path: Path, capsys) -> str:
    with pytest.raises(CheckpointError) as api_error:
        checkpoint_and_metadata(path)
    assert train_main(TINY + ["--train-iters", "3", "--load", str(path)]) == 2
    cli_error = capsys.readouterr().err
    assert str(api_error.value) in cli_error
    return str(api_error.value)


def copy_of(saved: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(saved, target)
    return target


def test_truncated_shard(saved, tmp_path, capsys):
    checkpoint = copy_of(saved, tmp_path)
    shard = next((checkpoint / "iter_0000002").glob("*.distcp"))
    with open(shard, "r+b") as stream:
        stream.truncate(shard.stat().st_size // 2)
    message = load_error(checkpoint, capsys)
    assert f"{shard.name} has" in message and "truncated" in message


def test_missing_metadata(saved, tmp_path, capsys):
    checkpoint = copy_of(saved, tmp_path)
    (checkpoint / "iter_0000002" / "mega_checkpoint.json").unlink()
    assert "mega_checkpoint.json is missing" in load_error(checkpoint, capsys)


def test_missing_tensor_index(saved, tmp_path, capsys):
    checkpoint = copy_of(saved, tmp_path)
    (checkpoint / "iter_0000002" / ".metadata").unlink()
    assert ".metadata is missing" in load_error(checkpoint, capsys)


def test_save_killed_while_replacing_the_same_iteration(saved, tmp_path, capsys):
    # publish() moves the old iter_0000002 aside before renaming the new one into its place; a kill
    # between the two renames leaves only the set-aside copy, which must still load and be kept.
    checkpoint = copy_of(saved, tmp_path)
    os.replace(checkpoint / "iter_0000002", checkpoint / ".trash-iter_0000002")
    (checkpoint / ".tmp-iter_0000002").mkdir()  # the new save, half written
    assert resolve_checkpoint(checkpoint) == checkpoint / ".trash-iter_0000002"
    assert train_main(TINY + ["--train-iters", "3", "--load", str(checkpoint), "--save", str(checkpoint)]) == 0
    assert "loaded checkpoint" in capsys.readouterr().out
    assert sorted(p.name for p in checkpoint.iterdir()) == ["iter_0000002", "iter_0000003", TRACKER_FILE]


def test_hugging_face_directory(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert "Hugging Face model directory" in load_error(tmp_path, capsys)


def test_megatron_legacy_checkpoint(tmp_path, capsys):
    rank_dir = tmp_path / "iter_0000100" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    (rank_dir / "model_optim_rng.pt").write_bytes(b"\x80\x02not-loaded")
    (tmp_path / TRACKER_FILE).write_text("abc")
    assert f"{TRACKER_FILE} holds 'abc'" in load_error(tmp_path, capsys)
    (tmp_path / TRACKER_FILE).unlink()
    assert "Megatron-LM checkpoint (legacy torch.save format)" in load_error(tmp_path, capsys)


def test_foreign_dcp_directory(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):
        dcp.save({"weight": torch.zeros(3)}, checkpoint_id=str(tmp_path))
    assert "torch.distributed.checkpoint directory without mega_checkpoint.json" in load_error(tmp_path, capsys)


def test_model_that_does_not_match(saved, capsys):
    assert train_main(TINY + ["--train-iters", "3", "--num-layers", "3", "--load", str(saved)]) == 2
    assert "does not match this model" in capsys.readouterr().err


def test_a_model_config_that_differs_where_shapes_agree_is_refused(saved, capsys):
    """8 heads of 8 channels in 8 groups have the QKV shape of the saved 4 heads of 16 channels;
    the norm epsilon has no shape at all. Dropout, recompute and the vocabulary padding may change."""
    reinterpreting = ["--num-attention-heads", "8", "--kv-channels", "8", "--num-query-groups", "8", "--norm-epsilon", "1e-6"]
    assert train_main(TINY + ["--train-iters", "3", *reinterpreting, "--load", str(saved)]) == 2
    error = capsys.readouterr().err
    assert "does not match this model: it was saved with num_attention_heads (--num-attention-heads) 4 where this " \
           "run has 8; num_query_groups (--num-query-groups) 4 where this run has 8; kv_channels (--kv-channels) 16 " \
           "where this run has 8; layernorm_epsilon (--norm-epsilon) 1e-05 where this run has 1e-06." in error
    may_change = ["--hidden-dropout", "0.3", "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
                  "--make-vocab-size-divisible-by", "96"]
    assert train_main(TINY + ["--train-iters", "3", *may_change, "--load", str(saved)]) == 0


def test_checkpoint_info(saved, capsys):
    assert info_main([str(saved)]) == 0
    out = capsys.readouterr().out
    assert "iteration:        2" in out and "model family:     gpt" in out and "complete:         yes" in out
    assert info_main([str(saved), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["layout"]["tp"] == 1 and described["num_parameters"] > 0
    assert info_main([str(saved.parent)]) == 1
    assert "is not a mega checkpoint" in capsys.readouterr().err


# -- contents: checksums catch what sizes cannot (issue 15, item 3) ----------------------------
def test_a_4k_overwrite_in_a_shard_is_caught_by_its_checksum(saved, tmp_path, capsys):
    checkpoint = copy_of(saved, tmp_path)
    shard = next((checkpoint / "iter_0000002").glob("*.distcp"))
    with open(shard, "r+b") as stream:  # same size, different bytes: loaded as NaNs before checksums
        stream.seek(shard.stat().st_size // 2)
        stream.write(b"\xff" * 4096)
    message = load_error(checkpoint, capsys)
    assert f"{shard.name} has checksum" in message and "damaged" in message
    assert info_main([str(checkpoint)]) == 1 and shard.name in capsys.readouterr().err
    assert verify_main([str(checkpoint)]) == 1
    assert f"DAMAGED  {checkpoint / 'iter_0000002'}" in capsys.readouterr().out
    assert verify_main([str(checkpoint), "--json"]) == 1
    (damaged,) = json.loads(capsys.readouterr().out)["checkpoints"]
    assert not damaged["intact"] and shard.name in damaged["error"]


def test_a_flipped_bit_in_a_weight_is_caught(saved, tmp_path, capsys):
    checkpoint = copy_of(saved, tmp_path)
    name = max(tensor_shapes(checkpoint), key=lambda n: torch.Size(tensor_shapes(checkpoint)[n][0]).numel())
    weight = read_tensors(checkpoint, [name])[name]
    for shard in (checkpoint / "iter_0000002").glob("*.distcp"):
        data = bytearray(shard.read_bytes())
        at = data.find(weight.numpy().tobytes()[:64])  # where the weight's first values are stored
        if at >= 0:
            data[at + 2] ^= 0x10  # a mantissa bit of its first value: silently changes it
            shard.write_bytes(bytes(data))
            break
    assert "has checksum" in load_error(checkpoint, capsys)
    # Unchecked (what happened before checksums), the flip loads as a different weight.
    changed = read_tensors(checkpoint, [name])[name]
    assert (changed != weight).sum() == 1


def test_a_damaged_tensor_index_is_one_clear_error(saved, tmp_path, capsys):
    checkpoint = copy_of(saved, tmp_path)
    index = checkpoint / "iter_0000002" / ".metadata"
    index.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(index.stat().st_size)))
    assert ".metadata has checksum" in load_error(checkpoint, capsys)
    # Unchecked (--no-verify-checksums, for checkpoints too big to read twice, or a checkpoint saved
    # before checksums), the unpickler's failure is named.
    assert train_main(TINY + ["--train-iters", "3", "--load", str(checkpoint), "--no-verify-checksums"]) == 2
    assert f"{index} (the checkpoint's tensor index) is damaged" in capsys.readouterr().err


def test_verify_checks_every_checkpoint_of_a_save_directory(saved, capsys):
    assert verify_main([str(saved)]) == 0
    out = capsys.readouterr().out
    assert f"ok       {saved / 'iter_0000002'}" in out and "1 of 1 checkpoint(s) intact" in out
    assert verify_main([str(saved), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "directory": str(saved), "intact": 1,
        "checkpoints": [{"path": str(saved / "iter_0000002"), "intact": True, "error": None}]}
    assert verify_main([str(saved / "missing")]) == 1


# -- one writer per save directory (issue 15, item 2) ------------------------------------------
def test_a_second_run_saving_into_a_directory_in_use_is_refused(tmp_path, capsys):
    import socket

    save_dir = tmp_path / "ckpt"
    holder = SaveDirLock(save_dir)  # another run, saving here
    assert train_main(TINY + ["--train-iters", "1", "--save", str(save_dir)]) == 2
    error = capsys.readouterr().err
    assert f"{save_dir} is in use by another run (pid {os.getpid()} on host {socket.gethostname()}" in error
    assert sorted(p.name for p in save_dir.iterdir()) == [LOCK_FILE]  # nothing of the refused run
    holder.release()
    assert train_main(TINY + ["--train-iters", "1", "--save", str(save_dir)]) == 0
    assert sorted(p.name for p in save_dir.iterdir()) == ["iter_0000001", TRACKER_FILE]  # lock released


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path):
    save_dir = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from mega.core.checkpoint.lock import "
                               "SaveDirLock; lock = SaveDirLock(sys.argv[1]); print('locked', flush=True); "
                               "time.sleep(60)", str(save_dir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    with pytest.raises(CheckpointError, match=f"pid {holder.pid} on host"):
        SaveDirLock(save_dir)
    holder.kill()
    holder.wait()
    assert (save_dir / LOCK_FILE).exists()  # left behind by the dead run...
    lock = SaveDirLock(save_dir)  # ...and taken over
    assert f"pid {holder.pid}" in lock.previous_holder
    lock.release()


# -- a full disk during a save (issue 15, item 4) ----------------------------------------------
def _can_mount_a_small_disk() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount_a_small_disk(), reason="needs unshare -rm (user and mount namespaces) for a tmpfs")
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    # A real full disk: a 2.5 MiB tmpfs (in a private mount namespace) where one checkpoint of this
    # model (1.7 MB) fits and the second does not; synchronous and --async-save.
    mega = f"{sys.executable} -m mega.core.cli.main"
    runs = []
    for mode in ("sync", "async"):
        disk = tmp_path / mode
        disk.mkdir()
        flags = " ".join(TINY + ["--train-iters", "3", "--save", str(disk / "ckpt"), "--save-interval", "1"]
                         + (["--async-save"] if mode == "async" else []))
        # What is left on the small disk is copied out before its namespace (and the tmpfs) goes.
        runs.append(f"mount -t tmpfs -o size=2560k tmpfs {disk} && {{ {mega} train {flags}; echo exit=$?; "
                    f"cp -r {disk / 'ckpt'} {tmp_path / (mode + '-left')}; }}")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", "; echo ===; ".join(runs)], capture_output=True,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    for mode, output in zip(("sync", "async"), result.stdout.split("===\n"), strict=True):
        assert "exit=2" in output, mode + result.stdout + result.stderr
        assert "training finished" not in output  # it did not
        left = tmp_path / (mode + "-left")
        assert {p.name for p in left.iterdir()} - {LOCK_FILE} == {"iter_0000001", TRACKER_FILE}  # no .tmp-iter
        assert checkpoint_and_metadata(left)[0] == left / "iter_0000001"  # the previous one, intact
    errors = [line for line in result.stderr.splitlines() if line.startswith("mega train: error:")]
    assert len(errors) == 2, result.stderr
    for mode, error in zip(("sync", "async"), errors, strict=True):
        assert f"no space left on device writing {tmp_path / mode / 'ckpt' / '.tmp-iter_0000002'} (needed ~" \
            in error, error
        assert re.search(r"\(needed ~[0-9.]+ [KM]iB, [0-9.]+ [KM]iB free once the partial checkpoint was removed\)",
                         error), error
    assert "Traceback" not in result.stderr and "inline_container" not in result.stderr


def test_a_load_directory_that_does_not_exist_is_said_loudly_and_refused_for_finetuning(tmp_path, capsys):
    missing = tmp_path / "chekpoints"  # a typo
    assert train_main(TINY + ["--train-iters", "1", "--load", str(missing)]) == 0
    assert f"WARNING: --load {missing} does not exist: training starts from scratch" in capsys.readouterr().err
    assert train_main(TINY + ["--train-iters", "1", "--load", str(missing), "--finetune"]) == 2
    assert f"--finetune: {missing} holds no checkpoint to fine-tune from" in capsys.readouterr().err
