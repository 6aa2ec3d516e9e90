"""``mega bench comm``: sizes, nccl-tests' bus-bandwidth factors, a real run on local gloo ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mega.train.bench import comm


def test_sizes_parse_like_nccl_tests():
    assert [comm.parse_size(text) for text in ("8", "64K", "128M", "1G")] == [8, 65536, 128 * 2**20, 2**30]
    assert comm.message_sizes(8, 128, 2, 0) == [8, 16, 32, 64, 128]
    assert comm.message_sizes(100, 400, 2, 100) == [100, 200, 300, 400]
    with pytest.raises(Exception, match="bad size '12Q'"):
        comm.parse_size("12Q")


def test_bus_bandwidth_factors_are_nccl_tests_ones():
    n = 4
    assert comm.bus_bandwidth("all_reduce", 1.0, n) == 2 * 3 / 4
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert comm.bus_bandwidth(op, 1.0, n) == 3 / 4
    assert comm.bus_bandwidth("broadcast", 1.0, n) == comm.bus_bandwidth("sendrecv", 1.0, n) == 1.0


@pytest.mark.parametrize("argv,message", [
    (["--nproc-per-node", "2", "--ops", "all_reduce,allreduce"], "unknown collective(s) allreduce"),
    (["--nproc-per-node", "2", "-b", "1M", "-e", "1K"], "must be >= 1 and <= -e/--maxbytes"),
    (["--nproc-per-node", "2", "-f", "1"], "-f/--stepfactor must be > 1"),
    ([], "run under torchrun"),
])
def test_bad_arguments_are_explained(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert comm.main(argv) == 2
    assert message in capsys.readouterr().err


def test_mega_bench_comm_runs_on_local_gloo_ranks():
    command = [sys.executable, "-m", "mega.core.cli.main", "bench", "comm", "--nproc-per-node", "2",
               "-b", "1K", "-e", "4K", "-n", "2", "-w", "1", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["world_size"] == 2 and report["backend"] == "gloo" and report["dtype"] == "float32"
    rows = report["results"]
    assert [(r["op"], r["size"]) for r in rows] == [(op, size) for op in comm.OPS for size in (1024, 2048, 4096)]
    for row in rows:
        assert row["wrong"] == 0, row
        per_rank_share = row["op"] in ("all_gather", "reduce_scatter", "all_to_all")
        assert row["count"] * 4 * (2 if per_rank_share else 1) == row["size"]
        assert row["time_us"] > 0
        assert row["algbw_gbps"] == pytest.approx(row["size"] / row["time_us"] / 1e3)
        assert row["busbw_gbps"] == pytest.approx(comm.bus_bandwidth(row["op"], row["algbw_gbps"], 2))
