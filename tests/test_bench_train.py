"""`mega bench train` on the CPU: one real short run per precision, the report in markdown and JSON."""

from __future__ import annotations

import json

import torch

from mega.train.bench.train import main as bench_main

TRAIN = ["--model-preset", "tiny", "--vocab-size", "512", "--seq-length", "64", "--mock-data",
         "--micro-batch-size", "2", "--train-iters", "3", "--eval-iters", "0", "--log-interval", "100"]


def test_bench_train_reports_a_timed_and_a_skipped_precision(tmp_path, capfd):
    # One real run per precision costs seconds (a process importing torch): fp32 and fp16 run the
    # same code as bf16 with other flags, so the test times bf16 and reports fp8 as skipped.
    # --json prints the JSON report (as `mega doctor --json`, `mega plan --json` do) and nothing
    # else: the runs' log lines (processes of their own, so read at the descriptor) go to stderr.
    output = tmp_path / "baseline"
    argv = [*TRAIN, "--warmup-iters", "1", "--precisions", "bf16,fp8", "--output", str(output), "--json"]
    assert bench_main(argv) == 0
    printed = capfd.readouterr()
    report = json.loads(output.with_suffix(".json").read_text())
    assert json.loads(printed.out) == report and " iteration        3/       3 |" in printed.err
    runs = {run["precision"]: run for run in report["runs"]}
    assert list(runs) == ["bf16", "fp8"]
    assert "Transformer Engine" in runs["fp8"]["skipped"]  # no fp8 backend on a CPU
    for precision in ("bf16",):
        run = runs[precision]
        assert run["timed_steps"] == 2 and run["step_time_s"] > 0 and run["peak_memory_gb"] > 0
        # tokens/s and samples/s describe the same steps: 64 tokens per sample.
        assert abs(run["tokens_per_s"] - 64 * run["samples_per_s"]) < 1e-6 * run["tokens_per_s"]
        assert run["mfu"] is None  # a CPU has no known peak
    assert report["environment"]["torch"] == torch.__version__
    markdown = output.with_suffix(".md").read_text()
    assert "| bf16 |" in markdown and "skipped: --fp8-hybrid needs NVIDIA Transformer Engine" in markdown
    assert f"torch {torch.__version__}" in markdown


def test_bench_train_rejects_an_unknown_precision(capsys):
    assert bench_main(["--precisions", "fp32,int4"]) == 2
    assert "--precisions: unknown int4" in capsys.readouterr().err


def test_bench_train_names_a_bad_train_flag(capsys):
    assert bench_main([*TRAIN, "--micro-batch-size", "0"]) == 2
    assert "--micro-batch-size must be positive" in capsys.readouterr().err


def test_bench_train_prints_the_markdown_report_by_default(tmp_path, capsys):
    # The report of a run that is all skipped: what is printed without --json is the markdown written.
    output = tmp_path / "skipped"
    assert bench_main([*TRAIN, "--precisions", "fp8", "--output", str(output)]) == 0
    assert capsys.readouterr().out == output.with_suffix(".md").read_text()
