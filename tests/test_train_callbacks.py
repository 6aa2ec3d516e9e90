"""Training callbacks through `mega train`: TensorBoard, the profiler, the pipeline timeline."""

from __future__ import annotations

import json
import subprocess
import sys

from mega.train.command import main

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
        "--mock-data", "--log-interval", "1"]


def test_tensorboard_scalars_and_profiler_trace(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    argv = TINY + ["--tensorboard-dir", str(tmp_path / "tb"), "--eval-interval", "2", "--eval-iters", "1",
                   "--profile", "--profile-step-start", "2", "--profile-step-end", "3",
                   "--profile-dir", str(tmp_path / "prof")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    losses = [float(line.split("lm loss: ")[1].split(" ")[0]) for line in out.splitlines() if "lm loss: " in line]

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"lm loss", "learning-rate", "grad-norm", "lm loss validation", "lm loss validation ppl"} <= set(scalars)
    logged = events.Scalars("lm loss")
    assert [e.step for e in logged] == [1, 2, 3]
    assert [round(e.value, 4) for e in logged] == [round(x, 4) for x in losses]
    assert [e.step for e in events.Scalars("lm loss validation")] == [2, 3]

    trace = json.loads((tmp_path / "prof" / "profile_rank0.json").read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    assert "profile of iterations 2-2 written to" in out


def test_pipeline_timeline_from_two_local_processes(tmp_path):
    path = tmp_path / "timeline.json"
    argv = TINY + ["--pipeline-model-parallel-size", "2", "--pipeline-timeline", str(path), "--nproc-per-node", "2"]
    result = subprocess.run([sys.executable, "-m", "mega.core.cli.main", "train", *argv],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # Only rank 0 prints the log line.
    assert sum(line.startswith(" iteration") for line in result.stdout.splitlines()) == 3
    trace = json.loads(path.read_text())["traceEvents"]
    spans = [event for event in trace if event["ph"] == "X"]
    assert {event["pid"] for event in spans} == {0, 1}
    names = {event["name"] for event in spans}
    assert {"F0 c0", "B0 c0", "F1 c0", "B1 c0"} <= names


def test_a_failing_rank_stops_the_local_job(tmp_path):
    # Rank 1 cannot find its data; the launcher must not hang waiting for it.
    argv = [w for w in TINY if w != "--mock-data"] + ["--data-path", str(tmp_path / "missing"), "--nproc-per-node", "2"]
    result = subprocess.run([sys.executable, "-m", "mega.core.cli.main", "train", *argv],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "missing.idx does not exist" in result.stderr
