"""The pipeline schedules against one process doing plain gradient accumulation (fp32, gloo).

The model: a tied word embedding, residual MLP blocks, and an output layer that reuses the
embedding weight, as a sequence of layers with ``[s, b, h]`` activations. Every layout runs
several SGD steps; losses, gradients and parameters must match one process within 1e-5.
"""

from __future__ import annotations

import json
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, SEQ, MICRO_BATCH, BLOCKS = 64, 32, 8, 2, 6
SEED, STEPS, LR = 1234, 3, 0.5
TOLERANCE = 1e-5


class Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, tokens):  # [b, s] -> [s, b, h]
        return self.word_embeddings(tokens).transpose(0, 1).contiguous()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_fc1 = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.linear_fc2 = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.linear_fc2(torch.tanh(self.linear_fc1(x)))


def build_layers(tied=True):
    torch.manual_seed(SEED)
    embedding = Embedding()
    blocks = [Block() for _ in range(BLOCKS)]
    output_layer = nn.Linear(HIDDEN, VOCAB, bias=False)
    if tied:
        output_layer.weight = embedding.word_embeddings.weight
    else:  # the same numbers, a parameter of its own (a V puts both on the first rank)
        output_layer.weight = nn.Parameter(embedding.word_embeddings.weight.detach().clone())
    return [embedding, *blocks, output_layer]


def microbatch(step, index):
    generator = torch.Generator().manual_seed(1000 * step + index)
    data = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def reference_run(num_microbatches, tied=True):
    """One process, no pipeline: accumulate the gradient of the mean loss, then SGD."""
    model = nn.Sequential(*build_layers(tied))
    history = []
    for step in range(STEPS):
        model.zero_grad()
        losses = []
        for index in range(num_microbatches):
            tokens, labels = microbatch(step, index)
            logits = model(tokens)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.t().reshape(-1))
            (loss / num_microbatches).backward()
            losses.append(loss.item())
        grads = {name: p.grad.clone() for name, p in model.named_parameters(remove_duplicate=False)}
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        history.append((losses, grads))
    params = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    return history, params


class CountingGradSync:
    """The data-parallel wrapper, counting how often the schedule holds its reduction back."""

    def __init__(self, ddp):
        self.ddp, self.no_sync_calls = ddp, 0

    def no_sync(self):
        self.no_sync_calls += 1
        return self.ddp.no_sync()

    def finish_grad_sync(self):
        self.ddp.finish_grad_sync()


class SavedActivations:
    """Bytes autograd holds for backward passes still to come (saved-tensor hooks)."""

    class Box:
        def __init__(self, tensor):
            self.tensor = tensor

    def __init__(self):
        self.live = self.peak = self.packed = 0

    def pack(self, tensor):
        box, size = self.Box(tensor), tensor.numel() * tensor.element_size()
        self.live += size
        self.packed += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(box, self.release, size)
        return box

    def release(self, size):
        self.live -= size

    def unpack(self, box):
        return box.tensor


def full_named_params(chunks, groups):
    """Each chunk parameter and gradient under its name in the whole model, tensor shards gathered."""
    from mega.core.parallel.layers import gather_shards
    from mega.core.parallel.param_attrs import is_tensor_parallel

    def whole(tensor, param):
        if is_tensor_parallel(param):
            return gather_shards(tensor, groups.tp, param.partition_dim, param.partition_chunks)
        return tensor.detach().clone()

    return {
        name: (whole(param, param), whole(param.main_grad, param))
        for chunk in chunks for name, param in chunk.named_parameters(remove_duplicate=False)
    }


def pipeline_run(layout, timeline_path=None):
    """Train STEPS steps with the pipeline in ``layout``; return what the test compares."""
    from mega.core.distributed import DDPConfig, DistributedDataParallel
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.core.parallel.cross_entropy import vocab_parallel_cross_entropy
    from mega.core.parallel.plan import Colwise, Rowwise, VocabEmbedding
    from mega.core.parallel.tensor_parallel import apply_tensor_parallel
    from mega.core.pipeline import (
        forward_backward,
        pipeline_chunks,
        schedule_table,
        setup_tied_weights,
        tie_across_stages,
    )
    from mega.core.plugins import Events

    tp, pp, vpp, m = layout["tp"], layout["pp"], layout.get("vpp"), layout["microbatches"]
    groups = ParallelGroups(ParallelConfig(tp=tp, pp=pp, vpp=vpp))
    plan = {"0.word_embeddings": VocabEmbedding(), "*.linear_fc1": Colwise(), "*.linear_fc2": Rowwise(),
            str(BLOCKS + 1): Colwise()}
    tied = layout.get("tied", True)
    model = apply_tensor_parallel(nn.Sequential(*build_layers(tied)), plan, groups)
    if tied:
        tie_across_stages(model[0].word_embeddings.weight)
    table = schedule_table(pp, m, vpp or 1, schedule=layout.get("schedule", "1f1b"))
    chunks = pipeline_chunks(list(model), groups, placement=table.placement)
    setup_tied_weights(chunks, groups)
    params = [p for chunk in chunks for p in chunk.parameters()]
    # Small buckets reduced during backward: a backward outside no_sync() too early would raise.
    ddp_config = DDPConfig(bucket_size=1000, overlap_grad_reduce=True)
    ddps = [DistributedDataParallel(chunk, groups, ddp_config) for chunk in chunks]
    syncs = [CountingGradSync(ddp) for ddp in ddps]
    timeline = None
    if timeline_path:  # the pipeline-timeline callback is mega-train's, a listener of the schedule's events
        from mega.train.pipeline_timeline import PipelineTimeline

        timeline = PipelineTimeline(timeline_path)
    events = Events([timeline] if timeline else [])
    saved = SavedActivations()

    def loss_fn(logits, labels):
        return vocab_parallel_cross_entropy(logits, labels.t(), groups.tp).mean()

    # Evaluation first: forwards only, same losses as training's first step, no gradients.
    data = (microbatch(0, groups.dp.rank * m + i) for i in range(m))
    schedule = layout.get("schedule", "1f1b")
    eval_losses = forward_backward(ddps, data, m, loss_fn, groups, tensor_shape=[SEQ, MICRO_BATCH, HIDDEN],
                                   grad_sync=syncs, events=events, forward_only=True, schedule=schedule)
    assert all(p.grad is None and not p.main_grad.any() for p in params)
    assert all(sync.no_sync_calls == 0 for sync in syncs)

    history = []
    for step in range(STEPS):
        events.hook.on_step_start(run=None, iteration=step)  # as the training loop does
        for ddp in ddps:
            ddp.zero_grad_buffer()
        first = groups.dp.rank * m  # this data-parallel replica's share of the global batch
        data = (microbatch(step, first + i) for i in range(m))
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            losses = forward_backward(ddps, data, m, loss_fn, groups, tensor_shape=[SEQ, MICRO_BATCH, HIDDEN],
                                      grad_sync=syncs, events=events, schedule=schedule)
        named = full_named_params(chunks, groups)
        history.append(([loss.item() for loss in losses], {name: grad for name, (_, grad) in named.items()}))
        with torch.no_grad():
            for p in params:
                p -= LR * p.main_grad
    chunk_forwards = m * len(chunks) * STEPS
    trace = None
    if timeline is not None:
        written = timeline.write()
        trace = json.loads(written.read_text()) if written else None
    return {
        "layout": layout,
        "dp_rank": groups.dp.rank,
        "pp_rank": groups.pp.rank,
        "loss_rank": table.rank_and_chunk(table.num_stages - 1)[0],  # (the first rank in a V)
        "eval_losses": [loss.item() for loss in eval_losses],
        "history": history,
        "params": {name: param for name, (param, _) in full_named_params(chunks, groups).items()},
        "no_sync_calls": sum(sync.no_sync_calls for sync in syncs),
        "in_flight": saved.peak / (saved.packed / chunk_forwards),
        "trace": trace,
    }


def run_layouts(layouts, timeline_path=None):
    """``layout["timeline"]``: the name of its timeline file beside ``timeline_path``."""
    return [pipeline_run(layout, str(timeline_path).replace("timeline.json", layout["timeline"])
                         if layout.get("timeline") else None) for layout in layouts]


def assert_close(actual, expected, what):
    scale = expected.abs().max().clamp_min(1e-12)
    error = ((actual - expected).abs().max() / scale).item()
    assert error <= TOLERANCE, f"{what}: relative error {error:.2e} > {TOLERANCE:.0e}"


def check_against_reference(results, reference_for):
    """Every rank's losses, gradients and final parameters match one process."""
    for rank, result in enumerate(results):
        layout = result["layout"]
        dp = len({r["dp_rank"] for r in results if r["layout"] == layout})
        m = layout["microbatches"]
        history, params = reference_for(dp * m, layout.get("tied", True))
        where = f"{layout} rank {rank}"
        for step, ((losses, grads), (ref_losses, ref_grads)) in enumerate(zip(result["history"], history, strict=True)):
            if result["pp_rank"] == result["loss_rank"]:
                mine = ref_losses[result["dp_rank"] * m:(result["dp_rank"] + 1) * m]
                assert losses == pytest.approx(mine, rel=TOLERANCE), f"{where} step {step} losses"
            else:
                assert losses == []
            if step == 0:
                assert result["eval_losses"] == pytest.approx(losses, rel=TOLERANCE), f"{where} evaluation"
            assert grads
            for name, grad in grads.items():
                assert_close(grad, ref_grads[name], f"{where} step {step} grad {name}")
        for name, param in result["params"].items():
            assert_close(param, params[name], f"{where} final {name}")
        # Every parameter of the model lives on some stage.
        names = {name for r in results if r["layout"] == layout for name in r["params"]}
        assert names == set(params), where
        # Each chunk's reduction ran once per step: all its backwards (and Ws) but the last under no_sync.
        halves = 2 if layout.get("schedule", "1f1b") != "1f1b" else 1
        assert result["no_sync_calls"] == STEPS * (layout.get("vpp") or 1) * (m - 1) * halves, where


@pytest.fixture(scope="module")
def reference_for():
    cache = {}

    def get(num_microbatches, tied=True):
        if (num_microbatches, tied) not in cache:
            cache[(num_microbatches, tied)] = reference_run(num_microbatches, tied)
        return cache[(num_microbatches, tied)]

    return get


def split_by_layout(results_per_rank):
    """worlds.run returns, per rank, one result per layout: regroup them per layout."""
    return list(zip(*results_per_rank, strict=True))


def test_no_pipelining_in_one_process_matches(reference_for):
    check_against_reference([pipeline_run({"tp": 1, "pp": 1, "microbatches": 4})], reference_for)
    # Split backwards on one process: the tied word embedding's gradient stays whole in B.
    check_against_reference([pipeline_run({"tp": 1, "pp": 1, "microbatches": 4, "schedule": "zb-h1"})], reference_for)


def test_1f1b_interleaved_and_zb_h1_on_two_ranks(worlds, reference_for):
    layouts = [{"tp": 1, "pp": 2, "microbatches": 4}, {"tp": 1, "pp": 2, "vpp": 2, "microbatches": 4},
               {"tp": 1, "pp": 2, "microbatches": 4, "schedule": "zb-h1"},
               {"tp": 1, "pp": 2, "vpp": 2, "microbatches": 4, "schedule": "zb-h1"},
               {"tp": 1, "pp": 2, "vpp": 2, "microbatches": 3, "schedule": "zbv", "tied": False},
               {"tp": 1, "pp": 2, "vpp": 2, "microbatches": 4, "schedule": "dualpipev", "tied": False}]
    for results in split_by_layout(worlds.run(2, run_layouts, layouts)):
        check_against_reference(results, reference_for)


def test_pp4_pp2xdp2_pp2xtp2_on_four_ranks_with_timeline(worlds, reference_for, tmp_path):
    layouts = [
        {"tp": 1, "pp": 4, "microbatches": 6, "timeline": "timeline.json"},
        {"tp": 1, "pp": 2, "microbatches": 3},
        {"tp": 2, "pp": 2, "microbatches": 3},
        {"tp": 1, "pp": 4, "microbatches": 6, "schedule": "zb-h1", "timeline": "zb-h1.json"},
        {"tp": 2, "pp": 2, "microbatches": 3, "schedule": "zb-h1"},
        {"tp": 1, "pp": 4, "vpp": 2, "microbatches": 4, "schedule": "zb-h1"},
        {"tp": 1, "pp": 4, "vpp": 2, "microbatches": 5, "schedule": "zbv", "tied": False},
        {"tp": 2, "pp": 2, "vpp": 2, "microbatches": 3, "schedule": "dualpipev", "tied": False},
    ]
    per_layout = split_by_layout(worlds.run(4, run_layouts, layouts, str(tmp_path / "timeline.json")))
    for results in per_layout:
        check_against_reference(results, reference_for)

    # Measured activations in flight never exceed 1F1B's promise: pp - rank on stage `rank`.
    pp4 = per_layout[0]
    assert [round(r["in_flight"], 6) for r in pp4] == [4, 3, 2, 1]

    # The timeline: valid Chrome trace JSON, written once by rank 0, one track per rank.
    trace = pp4[0]["trace"]
    assert trace is not None and all(r["trace"] is None for r in pp4[1:])
    assert json.loads((tmp_path / "timeline.json").read_text()) == trace
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in spans} == {(rank, 0) for rank in range(4)}
    assert all(isinstance(e["ts"], float) and e["dur"] >= 0 for e in spans)
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"process_name"}
    for rank in range(4):
        mine = [e["name"] for e in spans if e["pid"] == rank]
        passes = {"F": STEPS + 1, "B": STEPS}  # one evaluation, then training steps
        assert sorted(n for n in mine if n[0] in "FB") == sorted(
            f"{kind}{mb} c0" for kind in "FB" for mb in range(6) for _ in range(passes[kind]))
        assert mine.count("grad_sync") == STEPS
        assert any("send_forward" in n for n in mine) == (rank < 3)
        assert any("recv_backward" in n for n in mine) == (rank < 3)
    assert any(e["name"] == "idle" for e in spans)  # the bubble is explicit
    assert {e["args"]["iteration"] for e in spans} == {None, *range(STEPS)}

    # ZB-H1's timeline shows each backward's B and W apart, in the table's order.
    from mega.core.pipeline import schedule_table

    trace = per_layout[3][0]["trace"]
    table = schedule_table(4, 6, schedule="zb-h1")
    for rank in range(4):
        mine = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == rank
                and e["cat"] in ("forward", "backward", "weight_grad") and e["args"]["iteration"] == 0]
        assert mine == [str(action) for action in table.actions[rank]]
        assert sum(name.startswith("W") for name in mine) == 6


def owned_gradient_slices(num_microbatches):
    """pp2 x dp2 with the distributed optimizer's DDP: each rank's owned slice of every gradient."""
    from mega.core.distributed import DDPConfig, DistributedDataParallel
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.core.pipeline import forward_backward, pipeline_chunks, setup_tied_weights, tie_across_stages

    groups = ParallelGroups(ParallelConfig(pp=2))
    layers = build_layers()
    tie_across_stages(layers[0].word_embeddings.weight)
    (chunk,) = pipeline_chunks(layers, groups)
    setup_tied_weights([chunk], groups)
    ddp = DistributedDataParallel(chunk, groups, DDPConfig(bucket_size=None, use_distributed_optimizer=True))
    m = num_microbatches
    data = (microbatch(0, groups.dp.rank * m + i) for i in range(m))

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.t().reshape(-1))

    forward_backward([ddp], data, m, loss_fn, groups, tensor_shape=[SEQ, MICRO_BATCH, HIDDEN], grad_sync=ddp)
    names = {id(p): name for name, p in chunk.named_parameters()}
    owned = {}
    for buffer in ddp.grad_buffers:
        for bucket in buffer.buckets:
            low, high = bucket.shard_range(buffer.group)
            for param, (start, end) in zip(bucket.params, bucket.offsets, strict=True):
                if max(start, low) < min(end, high):
                    a, b = max(start, low) - start, min(end, high) - start
                    owned[names[id(param)]] = (a, b, param.main_grad.reshape(-1)[a:b].clone())
    return owned


def test_tied_grads_are_right_on_the_distributed_optimizers_shards(worlds, reference_for):
    history, _ = reference_for(4)
    ref_grads = history[0][1]  # the first step's gradients
    owners = {}
    for rank, owned in enumerate(worlds.run(4, owned_gradient_slices, 2)):
        for name, (a, b, grad) in owned.items():
            assert_close(grad, ref_grads[name].reshape(-1)[a:b], f"rank {rank} {name}[{a}:{b}]")
            owners.setdefault(name, []).append(rank)
    # Both copies of the tied weight are split between the two data-parallel ranks of their stage.
    assert owners["0.word_embeddings.weight"] == [0, 1] and owners[f"{BLOCKS + 1}.weight"] == [2, 3]


def test_pp2_tp2_dp2_on_eight_ranks(worlds, reference_for):
    layouts = [{"tp": 2, "pp": 2, "microbatches": 2}]
    for results in split_by_layout(worlds.run(8, run_layouts, layouts)):
        check_against_reference(results, reference_for)
