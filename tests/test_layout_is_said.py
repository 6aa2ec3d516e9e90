"""A run says its layout (issue 53, item 6): its first lines name the parallel sizes and the
data-parallel strategy (DDP, ZeRO-1/2/3, HSDP), and ``mega checkpoint info`` shows the strategy
and layout that saved. CPU only (gloo): one process, and two ranks under FSDP2 (ZeRO-3)."""

from __future__ import annotations

import contextlib
import io

from mega.core.checkpoint.layout_text import layout_text
from mega.train.checkpoint.info_command import main as info_main
from mega.train.command import main as train_main

TINY = ["--mock-data", "--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "32", "--seq-length", "16",
        "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1",
        "--eval-iters", "0", "--log-interval", "1000", "--lr", "1e-3"]


def printed_by_training(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert train_main(argv) == 0
    return out.getvalue()


def test_one_process_says_ddp(tmp_path, capsys):
    printed = printed_by_training([*TINY, "--save", str(tmp_path)])
    assert " layout: 1 ranks = tp 1 x cp 1 x ep 1 x dp 1 x pp 1; data parallelism: DDP" in printed
    assert info_main([str(tmp_path)]) == 0
    assert "saved by:         1 ranks = tp 1 x cp 1 x ep 1 x dp 1 x pp 1; data parallelism: DDP" in capsys.readouterr().out


def test_fsdp2_is_said_and_recorded(worlds, tmp_path, capsys):
    printed = worlds.run(2, printed_by_training, [*TINY, "--use-torch-fsdp2", "--save", str(tmp_path)])
    assert "layout: 2 ranks = tp 1 x cp 1 x ep 1 x dp 2 x pp 1; data parallelism: ZeRO-3 (FSDP2)" in printed[0]
    assert "layout:" not in printed[1]  # rank 0 says it
    assert info_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "data_parallel_strategy=optim_grads_params" in out and "data parallelism: ZeRO-3 (FSDP2)" in out


def test_every_strategy_has_its_name():
    names = {strategy: layout_text({"world_size": 8, "dp": 8, "data_parallel_strategy": strategy})
             for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params")}
    assert [text.split("data parallelism: ")[1] for text in names.values()] == [
        "DDP", "ZeRO-1 (distributed optimizer)", "ZeRO-2 (FSDP2)", "ZeRO-3 (FSDP2)"]
    hybrid = layout_text({"world_size": 8, "dp": 8, "data_parallel_strategy": "optim_grads_params",
                          "data_parallel_replicas": 2, "tp": 1, "vpp": 2, "sequence_parallel": True})
    assert hybrid == ("8 ranks = tp 1 x cp 1 x ep 1 x dp 8 x pp 1, vpp 2, sequence parallel; "
                      "data parallelism: HSDP (ZeRO-3 (FSDP2) within each of 2 replicas)")
    # A checkpoint of an older mega records only --use-distributed-optimizer.
    assert layout_text({"world_size": 2, "dp": 2, "distributed_optimizer": True}).endswith("ZeRO-1 (distributed optimizer)")
