"""The pipeline timeline: trace assembly and its registration as a callback plugin."""

from __future__ import annotations

import json

from mega.core.pipeline import forward_backward
from mega.core.plugins import Events, load_plugins
from mega.train.config import LoggingConfig
from mega.train.pipeline_timeline import PipelineTimeline, chrome_trace, timeline_callback
from mega.train.run_config import RunConfig


def span(name, category, ts, dur, iteration=0):
    return {"name": name, "cat": category, "ph": "X", "ts": ts, "dur": dur, "args": {"iteration": iteration}}


def test_gaps_become_idle_spans_within_each_iteration():
    rank0 = [span("F0 c0", "forward", 100.0, 10.0), span("B0 c0", "backward", 130.0, 10.0),
             span("F0 c0", "forward", 500.0, 10.0, iteration=1)]
    rank1 = [span("recv_forward", "p2p", 100.0, 10.0), span("F0 c0", "forward", 110.0, 20.0),
             span("F0 c0", "forward", 505.0, 10.0, iteration=1)]
    trace = chrome_trace([rank0, rank1])
    idle = sorted((e["pid"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e["name"] == "idle")
    # Times are relative to the first span (100 µs); iteration 0 spans 0..40, iteration 1 400..415.
    assert idle == [(0, 10.0, 20.0), (0, 410.0, 5.0), (1, 30.0, 10.0), (1, 400.0, 5.0)]
    assert trace["otherData"]["time_us_per_category"]["rank 1"] == {"p2p": 10.0, "forward": 30.0, "idle": 15.0}
    tracks = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert tracks == {(0, "rank 0"), (1, "rank 1")}


def test_one_process_run_writes_a_trace(tmp_path):
    import torch

    from mega.core.parallel import ParallelConfig, ParallelGroups

    timeline = PipelineTimeline(tmp_path / "trace.json")
    model = torch.nn.Linear(4, 4)
    data = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(3)]
    forward_backward(model, data, 3, torch.nn.functional.mse_loss, ParallelGroups(ParallelConfig()),
                     events=Events([timeline]))
    timeline.on_train_end(run=None)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = [e["name"] for e in events if e["ph"] == "X" and e["cat"] != "idle"]
    assert names == ["F0 c0", "B0 c0", "F1 c0", "B1 c0", "F2 c0", "B2 c0", "grad_sync"]


def test_registered_as_a_callback_wanted_only_with_a_path():
    plugins = load_plugins(environ={"MEGA_LOAD_PLUGINS": "train"})
    factory = plugins.callbacks.get("pipeline-timeline")
    assert factory is timeline_callback
    assert factory(RunConfig(model=None)) is None
    wanted = RunConfig(model=None, logging=LoggingConfig(pipeline_timeline="t.json"))
    assert isinstance(factory(wanted), PipelineTimeline)
