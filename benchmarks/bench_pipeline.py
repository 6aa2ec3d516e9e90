"""Pipeline schedules on this machine: step time at pp = 2 and 4 against pp = 1 for the same work.

One model (a tied embedding, residual MLP blocks, an output layer reusing the embedding) and one
global batch of ``--microbatches`` micro-batches, trained with SGD at each pipeline size; every
rank is one process with one thread, joined by gloo. Stages get equal compute: the output layer
costs about one block, so with ``--blocks + 1`` units split evenly the first stage also takes the
(cheap) embedding.

Columns: step time (median over the timed steps), speed-up over pp = 1, the bubble the schedule
predicts, (p-1)/(m+p-1) for 1F1B and (p-1)/(v*m+p-1) interleaved, a zero-bubble schedule's from its
slotted table (F = B = W; docs/pipeline.md), the step time that bubble
predicts with one core per stage (pp=1's time / pp / (1 - bubble)), and from the pipeline
timeline each rank's compute time per step and the share of each step it spent not computing
(waiting in p2p, idle). The layouts run in alternation, round after round, each in its own set
of processes, so that load from other jobs drifts over all of them alike.

    python benchmarks/bench_pipeline.py            # pp 1, 2, 4 and interleaved 2x2
    python benchmarks/bench_pipeline.py --layouts 1 4 4/zb-h1 4x2 4x2/zb-h1 4x2/zbv 4x2/dualpipev
    python benchmarks/bench_pipeline.py --json

A layout is ``PP``, ``PPxVPP`` (interleaved) and ``/SCHEDULE`` (``--pipeline-schedule``). The
V schedules (zbv, dualpipev) put the embedding and the output layer on the first rank: their
model unties them (same numbers).

The bubble against theory: ``--layer-ms C`` gives every layer (a block, the output layer) a fixed
cost of C ms in each of F, B and W, so that the schedule, not the machine, sets the timeline:
each F, B and W of a model chunk computes (a small model: pass ``--hidden 32``) and then sleeps
until ``layers x C`` has passed; a schedule without W runs B and W as one backward of ``2 C`` per
layer. Equal F, B and W costs are a linear layer's: three products of the same size (``x W^T``,
``g W``, ``g^T x``). A sleep, not a busy loop, so that ranks sharing cores do not slow each other;
on a busy machine ``--realtime`` keeps other jobs from delaying the ranks' wake-ups.
It prints each rank's bubble per step (the step's schedule, from the first span on any rank to
the last end, less the rank's F, B and W time) next to the table's (its idle unit slots, or
``(pp-1)(F + B + W)`` for 1F1B and interleaved 1F1B), the bubble share of the step, and the peak
memory a rank allocated during one more (profiled) step:

    python benchmarks/bench_pipeline.py --layer-ms 100 --hidden 32 --seq 128 --realtime \
        --layouts 4 4/zb-h1 4x2 4x2/zb-h1 4x2/zbv 4x2/dualpipev

The peak memory does not depend on the costs (mega.testing.peak_memory: the allocator's
record of one step), so ``--layer-ms 1 --rounds 1 --steps 1`` gives the same figures in seconds.

``--model gpt`` or ``--model llama`` runs a real model of that family instead of the MLP blocks
(``--blocks`` transformer layers of ``--hidden``, 4 heads, vocabulary 8 x hidden, untied, its own
loss), split the same way: what a micro-batch holds for its W depends on the layers (an MLP
block's W keeps 10h floats per token against the 9h its forward saved, a LLaMA layer's about
4/5 of what it saved), and so does how ZB-H1's memory compares with 1F1B's in bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from mega.core.parallel.grad_accumulation_fusion import Linear
from mega.core.parallel.output_layer_loss import output_layer_cross_entropy, output_layer_defers
from mega.core.pipeline import ScheduleError, schedule_table
from mega.core.plugins import hookimpl
from mega.testing.peak_memory import peak_allocated_bytes


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)

    def forward(self, tokens):  # [b, s] -> [s, b, h]
        return self.word_embeddings(tokens).transpose(0, 1).contiguous()


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        # mega's linear: its weight gradient is what the zero-bubble schedules defer to W
        self.linear_fc1 = Linear(hidden, 4 * hidden)
        self.linear_fc2 = Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.linear_fc2(F.gelu(self.linear_fc1(x)))


class OutputLayer(Linear):
    """mega's linear; where a zero-bubble schedule defers its weight gradient it hands the loss its
    input and weight instead of logits, as the language models' last stage does, so that the
    loss's W rebuilds the logits' gradient (mega.core.parallel.output_layer_loss)."""

    def forward(self, x):
        if output_layer_defers(self.weight):
            return {"output_hidden": x, "output_weight": self.weight}
        return super().forward(x)


def loss_of(outputs, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the output layer's logits, or of its input and weight."""
    if isinstance(outputs, dict):
        hidden = outputs["output_hidden"]
        return output_layer_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), outputs["output_weight"],
                                          labels.t().reshape(-1), None).mean()
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), labels.t().reshape(-1))


def build_layers(args, tied: bool = True) -> list[nn.Module]:
    torch.manual_seed(0)
    # Vocabulary 8h: the output layer's 2*h*V flops per token equal one block's 2*2*h*4h.
    embedding = Embedding(8 * args.hidden, args.hidden)
    output_layer = OutputLayer(args.hidden, 8 * args.hidden, bias=False)
    if tied:
        output_layer.weight = embedding.word_embeddings.weight
    else:
        output_layer.weight = nn.Parameter(embedding.word_embeddings.weight.detach().clone())
    return [embedding, *[Block(args.hidden) for _ in range(args.blocks)], output_layer]


def family_chunks(args, groups, table):
    """This rank's chunks of a real model of ``args.model``'s family (``--blocks`` transformer layers of
    hidden ``--hidden``, vocabulary 8 x hidden, untied, no dropout) split as the MLP model is (the
    output layer counted as a layer, the embedding free): the chunks, their costed layers, the
    family's loss and the stage boundaries for ``forward_backward``."""
    from mega.core.build import build_stage
    from mega.core.model_family import LossContext
    from mega.core.pipeline.actions import stage_of
    from mega.core.plugins import get_plugins

    family = get_plugins().models.get(args.model)
    config = family.preset("tiny", num_layers=args.blocks, hidden_size=args.hidden, num_attention_heads=4,
                           seq_length=args.seq, max_position_embeddings=args.seq, vocab_size=8 * args.hidden,
                           hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True)
    pp, vpp = table.pp, table.vpp
    decoder = balanced_layers_per_stage(args, pp * vpp)
    decoder[0], decoder[-1] = decoder[0] - 1, decoder[-1] - 1  # the embedding, the output layer
    stages = family.stages(config, pp, vpp, decoder)
    mine = [stages[stage_of(groups.pp.rank, chunk, pp, table.placement)] for chunk in range(vpp)]
    chunks = [build_stage(family, config, stage, groups=groups, seed=0) for stage in mine]
    costed = [len(stage.layers["decoder"]) + stage.is_last for stage in mine]
    context = LossContext(config, kernels=chunks[0].kernels)

    def loss_fn(outputs, labels):
        return family.loss(outputs, {"labels": labels, "loss_mask": torch.ones(labels.shape)}, context)[0]

    def boundary(index):
        return family.boundary(config, stages[index], args.micro_batch, groups.config, torch.float32)

    return chunks, costed, loss_fn, {"boundary": boundary}


class FixedCost:
    """Schedule listener: each F, B and W of a model chunk lasts ``layers x layer_s`` (a backward
    that includes W, ``2 x``): after the chunk's compute it sleeps for what is left. Registered
    after the timeline, so pluggy calls it first and the timeline's spans include the sleep."""

    def __init__(self, layers_per_chunk: list[int], layer_s: float, splits_backward: bool):
        self.layers, self.layer_s = layers_per_chunk, layer_s
        self.backward_layers = 1 if splits_backward else 2
        self.starts: dict[tuple, float] = {}
        self.overruns = 0  # actions whose compute alone took longer than their cost

    def _start(self, kind, microbatch, chunk):
        self.starts[(kind, microbatch, chunk)] = time.perf_counter()

    def _end(self, kind, microbatch, chunk, per_layer):
        left = self.starts.pop((kind, microbatch, chunk)) + self.layers[chunk] * per_layer * self.layer_s \
            - time.perf_counter()
        if left > 0:
            time.sleep(left)
        else:
            self.overruns += 1

    @hookimpl
    def on_forward_start(self, microbatch, chunk):
        self._start("F", microbatch, chunk)

    @hookimpl
    def on_forward_end(self, microbatch, chunk):
        self._end("F", microbatch, chunk, 1)

    @hookimpl
    def on_backward_start(self, microbatch, chunk):
        self._start("B", microbatch, chunk)

    @hookimpl
    def on_backward_end(self, microbatch, chunk):
        self._end("B", microbatch, chunk, self.backward_layers)

    @hookimpl
    def on_weight_grad_start(self, microbatch, chunk):
        self._start("W", microbatch, chunk)

    @hookimpl
    def on_weight_grad_end(self, microbatch, chunk):
        self._end("W", microbatch, chunk, 1)


def set_realtime(on: bool) -> None:
    """Every thread of this rank (gloo's too) under SCHED_FIFO, or back to the default policy: a
    rank that wakes (a sleep ends, a message arrives) then runs at once, whatever else the machine
    runs. The ranks of a fixed-cost run sleep almost all the time. Needs root (CAP_SYS_NICE)."""
    policy, priority = (os.SCHED_FIFO, 1) if on else (os.SCHED_OTHER, 0)
    for thread in os.listdir("/proc/self/task"):
        os.sched_setscheduler(int(thread), policy, os.sched_param(priority))


def balanced_layers_per_stage(args, stages: int) -> list[int]:
    units = args.blocks + 1  # blocks and the output layer
    if units % stages:
        sys.exit(f"error: --blocks + 1 = {units} must divide by the {stages} pipeline stages")
    counts = [units // stages] * stages
    counts[0] += 1  # the embedding
    return counts


def time_pipeline(args, pp: int, vpp: int | None, schedule: str, trace_path: str | None) -> dict:
    """On every rank: one untimed step, then ``args.steps`` timed ones; return the step times and
    this rank's timeline spans (and write the Chrome trace if ``trace_path`` is set)."""
    import torch.distributed as dist

    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.core.pipeline import forward_backward, pipeline_chunks, setup_tied_weights, tie_across_stages
    from mega.core.plugins import Events
    from mega.train.pipeline_timeline import PipelineTimeline

    groups = ParallelGroups(ParallelConfig(pp=pp, vpp=vpp))
    table = schedule_table(pp, args.microbatches, vpp or 1, schedule=schedule)
    vocab = 8 * args.hidden
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (args.micro_batch, args.seq + 1), generator=generator)
               for _ in range(args.microbatches)]
    if args.model == "mlp":
        # Fixed costs: untied, so that no rank waits in the tied embedding's all-reduce.
        tied = table.placement == "interleaved" and not args.layer_ms
        layers = build_layers(args, tied)
        if tied:
            tie_across_stages(layers[0].word_embeddings.weight)
        chunks = pipeline_chunks(layers, groups, balanced_layers_per_stage(args, pp * (vpp or 1)), table.placement)
        costed = [sum(not isinstance(layer, Embedding) for layer in chunk) for chunk in chunks]
        data = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in batches]
        loss_fn, shapes = loss_of, {"tensor_shape": [args.seq, args.micro_batch, args.hidden]}
    else:
        chunks, costed, loss_fn, shapes = family_chunks(args, groups, table)
        data = [({"tokens": b[:, :-1].contiguous()}, b[:, 1:].contiguous()) for b in batches]
    setup_tied_weights(chunks, groups)
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    timeline = PipelineTimeline(trace_path)
    listeners = [timeline]
    if args.layer_ms:
        listeners.append(FixedCost(costed, args.layer_ms / 1000, table.splits_backward))
    events = Events(listeners)

    def train_step():
        optimizer.zero_grad()
        forward_backward(chunks, data, args.microbatches, loss_fn, groups, events=events, schedule=schedule,
                         **shapes)
        optimizer.step()

    if args.realtime:
        set_realtime(True)
    times = []
    for step in range(1 + args.steps):
        events.hook.on_step_start(run=None, iteration=step)
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        train_step()
        if dist.is_initialized():
            dist.barrier()
        if step > 0:
            times.append(time.perf_counter() - start)
    if args.realtime:
        set_realtime(False)
    if trace_path:
        timeline.write()
    result = {"times": times, "spans": [s for s in timeline.spans if s["args"]["iteration"] > 0]}
    if args.layer_ms:
        result["overruns"] = listeners[1].overruns
        optimizer.zero_grad()
        events.hook.on_step_start(run=None, iteration=None)  # out of the timed iterations
        result["peak_bytes"] = peak_allocated_bytes(train_step)
    return result


def bubble_per_rank(spans_per_rank: list[list[dict]]) -> tuple[float, float]:
    """The median over steps of a rank's bubble (s: the step's schedule, from the first span on
    any rank to the last end, less the rank's F, B and W time), averaged over the ranks, and its
    share of the step's schedule."""
    bubbles, shares = [], []
    for iteration in {s["args"]["iteration"] for spans in spans_per_rank for s in spans}:
        mine = [[s for s in spans if s["args"]["iteration"] == iteration] for spans in spans_per_rank]
        every = [s for spans in mine for s in spans]
        window = max(s["ts"] + s["dur"] for s in every) - min(s["ts"] for s in every)
        idle = [window - sum(s["dur"] for s in spans if s["cat"] in ("forward", "backward", "weight_grad"))
                for spans in mine]
        bubbles.append(statistics.mean(idle) / 1e6)
        shares.append(statistics.mean(idle) / window)
    return statistics.median(bubbles), statistics.median(shares)


def held_to_w(spans_per_rank: list[list[dict]], splits_backward: bool) -> list[int]:
    """Each rank's most micro-batch chunks held at once, from forward to W (to the backward where
    there is no W), read from the timeline: the paper's memory accounting."""
    freed_by = "weight_grad" if splits_backward else "backward"
    peaks = []
    for spans in spans_per_rank:
        held = peak = 0
        for span in sorted(spans, key=lambda span: span["ts"]):
            held += 1 if span["cat"] == "forward" else -1 if span["cat"] == freed_by else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def theoretical_bubble(args, pp: int, vpp: int | None, table) -> tuple[float, float]:
    """A rank's bubble per step (s) and its share of the step, with F = B = W = ``--layer-ms`` per
    layer: a slotted table's idle slots; 1F1B's (pp - 1) (F + B + W) of one virtual stage."""
    chunk_s = (args.blocks + 1) / (pp * (vpp or 1)) * args.layer_ms / 1000
    work = 3 * args.microbatches * (vpp or 1) * chunk_s
    idle = (len(table.steps[0]) - 3 * args.microbatches * (vpp or 1) if table.slotted else 3 * (pp - 1)) * chunk_s
    return idle, idle / (work + idle)


def compute_and_waiting(spans_per_rank: list[list[dict]]) -> tuple[float, float]:
    """Mean compute time of a rank per step (s), and the mean share of a step's schedule (first
    span on any rank to last end) that a rank spent not computing (waiting in p2p, idle)."""
    computes, shares = [], []
    for iteration in {s["args"]["iteration"] for spans in spans_per_rank for s in spans}:
        mine = [[s for s in spans if s["args"]["iteration"] == iteration] for spans in spans_per_rank]
        every = [s for spans in mine for s in spans]
        window = max(s["ts"] + s["dur"] for s in every) - min(s["ts"] for s in every)
        for spans in mine:
            busy = sum(s["dur"] for s in spans if s["cat"] in ("forward", "backward", "weight_grad"))
            computes.append(busy / 1e6)
            shares.append(1 - busy / window)
    return statistics.mean(computes), statistics.mean(shares)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=7, help="MLP blocks or transformer layers (blocks + 1 must "
                                                                "divide by pp*vpp)")
    parser.add_argument("--model", choices=("mlp", "gpt", "llama"), default="mlp",
                        help="residual MLP blocks, or a real GPT or LLaMA (transformer layers, its loss)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round (after one untimed)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="rounds over all layouts; alternating spreads load drift over every layout")
    parser.add_argument("--layouts", nargs="+", default=["1", "2", "4", "2x2"],
                        help="pipeline sizes, PPxVPP for interleaved, /SCHEDULE for another --pipeline-schedule "
                             "(4/zb-h1, 4x2/zbv); the first is the baseline")
    parser.add_argument("--trace-dir", default=os.path.join(tempfile.gettempdir(), "mega-bench-pipeline"),
                        help="where the Chrome traces of the last round go")
    parser.add_argument("--layer-ms", type=float, default=None,
                        help="a fixed cost per layer of each F, B and W (ms, a sleep after the compute): measure "
                             "the bubble against the table's")
    parser.add_argument("--realtime", action="store_true",
                        help="time the steps with every rank's threads under SCHED_FIFO (root): with --layer-ms on a "
                             "busy machine, so that other jobs do not delay the ranks' wake-ups")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    from mega.testing import DistributedWorld

    layouts = []
    for text in args.layouts:
        sizes, _, schedule = text.partition("/")
        pp, _, vpp_text = sizes.partition("x")
        pp, vpp = int(pp), int(vpp_text) if vpp_text else None
        try:
            table = schedule_table(pp, args.microbatches, vpp or 1, schedule=schedule or "1f1b")
        except ScheduleError as error:
            sys.exit(f"error: layout {text}: {error}")
        balanced_layers_per_stage(args, pp * (vpp or 1))  # fail early on an uneven split
        layouts.append((pp, vpp, schedule or "1f1b", table))

    cores = os.cpu_count() or 1
    worlds = [DistributedWorld(pp, timeout_s=600) for pp, *_ in layouts]
    step_times = [[] for _ in layouts]
    spans = [[[] for _ in range(pp)] for pp, *_ in layouts]
    fixed = [{"peak_bytes": [], "overruns": 0} for _ in layouts]
    try:
        for round_index in range(args.rounds):
            for i, ((pp, vpp, schedule, _), world) in enumerate(zip(layouts, worlds, strict=True)):
                last = round_index == args.rounds - 1
                name = f"pipeline_pp{pp}_vpp{vpp or 1}_{schedule}.json"
                trace = os.path.join(args.trace_dir, name) if last else None
                results = world.run(time_pipeline, args, pp, vpp, schedule, trace)
                # A step ends when the slowest rank finishes it.
                step_times[i] += [max(steps) for steps in zip(*(r["times"] for r in results), strict=True)]
                for rank, result in enumerate(results):
                    spans[i][rank] += [{**s, "args": {"iteration": (round_index, s["args"]["iteration"])}}
                                       for s in result["spans"]]
                if args.layer_ms:
                    fixed[i]["peak_bytes"].append([r["peak_bytes"] for r in results])
                    fixed[i]["overruns"] += sum(r["overruns"] for r in results)
    finally:
        for world in worlds:
            world.close()
    if args.layer_ms:
        return print_fixed_cost(args, layouts, step_times, spans, fixed, cores)

    rows = []
    baseline = statistics.median(step_times[0])
    for (pp, vpp, schedule, table), times, rank_spans in zip(layouts, step_times, spans, strict=True):
        step_time = statistics.median(times)
        if table.slotted:  # F = B = W: the table's slots are its makespan
            bubble = 1 - 3 * args.microbatches * (vpp or 1) / len(table.steps[0])
        else:
            bubble = (pp - 1) / ((vpp or 1) * args.microbatches + pp - 1)
        compute, waiting = compute_and_waiting(rank_spans)
        rows.append({
            "layout": f"pp={pp}" + (f" vpp={vpp}" if vpp else "") + (f" {schedule}" if schedule != "1f1b" else ""),
            "step_ms": 1000 * step_time, "speedup": baseline / step_time,
            "bubble_formula": bubble,
            # One core per stage: the baseline's work split pp ways, stretched by the bubble.
            "predicted_ms": 1000 * baseline / pp / (1 - bubble) if pp <= cores else None,
            "compute_ms_per_rank": 1000 * compute, "not_computing_measured": waiting,
        })

    if args.json:
        print(json.dumps({"cores": cores, "args": vars(args), "rows": rows}, indent=2))
        return 0
    print(f"{cores} cores, one thread per rank; {args.blocks} blocks of hidden {args.hidden}, seq {args.seq}, "
          f"micro-batch {args.micro_batch}, {args.microbatches} micro-batches; median of "
          f"{args.rounds}x{args.steps} steps")
    print("| layout | step ms | speed-up | bubble (formula) | predicted ms | compute ms/rank | not computing |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        predicted = f"{row['predicted_ms']:.0f}" if row["predicted_ms"] else f"- (pp > {cores} cores)"
        print(f"| {row['layout']} | {row['step_ms']:.0f} | {row['speedup']:.2f}x | {row['bubble_formula']:.1%} | "
              f"{predicted} | {row['compute_ms_per_rank']:.0f} | {row['not_computing_measured']:.1%} |")
    return 0


def print_fixed_cost(args, layouts, step_times, spans, fixed, cores) -> int:
    """The ``--layer-ms`` report: each layout's bubble measured and from its table, and how
    ZB-H1's compares with 1F1B's at the same pp."""
    rows = []
    for (pp, vpp, schedule, table), times, rank_spans, extra in zip(layouts, step_times, spans, fixed, strict=True):
        bubble, share = bubble_per_rank(rank_spans)
        theory, theory_share = theoretical_bubble(args, pp, vpp, table)
        rows.append({
            "layout": f"pp={pp}" + (f" vpp={vpp}" if vpp else "") + f" {schedule}", "pp": pp, "vpp": vpp or 1,
            "schedule": schedule, "step_ms": 1000 * statistics.median(times),
            "bubble_ms": 1000 * bubble, "bubble_theory_ms": 1000 * theory, "bubble_vs_theory": bubble / theory if theory else None,
            "share": share, "share_theory": theory_share,
            # A rank's peak in each round; the pipeline needs its largest rank's.
            "peak_mib_per_rank": [max(peaks) / 2**20 for peaks in zip(*extra["peak_bytes"], strict=True)],
            "held_to_w_per_rank": held_to_w(rank_spans, table.splits_backward),
            "overruns": extra["overruns"],
        })
    if args.json:
        print(json.dumps({"cores": cores, "load": os.getloadavg(), "args": vars(args), "rows": rows}, indent=2))
        return 0
    print(f"{cores} cores (load average {os.getloadavg()[0]:.1f}), one thread per rank; F = B = W = {args.layer_ms} ms "
          f"per layer, {args.blocks} blocks + output layer of hidden {args.hidden}, seq {args.seq}, micro-batch "
          f"{args.micro_batch}, {args.microbatches} micro-batches; median of {args.rounds}x{args.steps} steps")
    print("| layout | step ms | bubble ms/rank | table's | measured/table | bubble share | table's | peak MiB per rank "
          "| held F to W |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        ratio = f"{row['bubble_vs_theory']:.2f}" if row["bubble_vs_theory"] else "-"
        peaks = " / ".join(f"{peak:.2f}" for peak in row["peak_mib_per_rank"])
        print(f"| {row['layout']} | {row['step_ms']:.0f} | {row['bubble_ms']:.0f} | {row['bubble_theory_ms']:.0f} | "
              f"{ratio} | {row['share']:.1%} | {row['share_theory']:.1%} | {peaks} | "
              f"{' / '.join(map(str, row['held_to_w_per_rank']))} |")
    for row in rows:
        base = next((r for r in rows if (r["pp"], r["vpp"], r["schedule"]) == (row["pp"], 1, "1f1b")), None)
        if row["schedule"] == "zb-h1" and row["vpp"] == 1 and base:
            print(f"pp={row['pp']}: ZB-H1's bubble {row['bubble_ms'] / base['bubble_ms']:.0%} of 1F1B's "
                  f"(table: {row['bubble_theory_ms'] / base['bubble_theory_ms']:.0%}); share "
                  f"{row['share'] / base['share']:.0%} ({row['share_theory'] / base['share_theory']:.0%}); peak memory "
                  f"{max(row['peak_mib_per_rank']) / max(base['peak_mib_per_rank']):.0%} of 1F1B's (largest rank)")
    if any(row["overruns"] for row in rows):
        print("overruns (compute longer than its fixed cost): "
              + ", ".join(f"{row['layout']}: {row['overruns']}" for row in rows if row["overruns"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
