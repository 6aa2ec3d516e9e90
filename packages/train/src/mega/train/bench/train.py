"""``mega bench train``: the baseline report - one short `mega train` per precision.

    mega bench train --model-preset tiny --mock-data --train-iters 8
    mega bench train --nproc-per-node 8 --model-preset 1.3b --mock-data --micro-batch-size 4 ...

Every precision (fp32, fp16, bf16, and fp8 where a kernel backend offers it) runs in processes of
its own (started like `mega train --nproc-per-node N`), so each peak memory is that run's. The
first ``--warmup-iters`` steps are left out; the report gives the median step time, samples/s, tokens/s,
TFLOP/s per GPU, MFU (where the GPU's peak is known) and peak memory, under the environment
`mega doctor` sees, as markdown and JSON (both written; ``--json`` prints the JSON instead of the
markdown). The runs' own log lines go to stderr, so stdout holds the report alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from mega.core.cli.argparser import CommandParser
from mega.core.config import ConfigError
from mega.core.parallel import ParallelGroups
from mega.core.plugins import PluginError, get_plugins, hookimpl
from mega.core.process_group import init_distributed
from mega.train.data_setup import build_datasets
from mega.train.device_peaks import peak_tflops
from mega.train.doctor.checks import run_checks
from mega.train.interval_metrics import peak_memory_gb
from mega.train.launch import launch_local
from mega.train.precision import model_dtype
from mega.train.run_config import check_supported, derive
from mega.train.run_parser import parse_run
from mega.train.trainer import Trainer

PRECISION_FLAGS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"], "fp8": ["--bf16", "--fp8-hybrid"]}
COLUMNS = [("precision", "precision"), ("step_time_s", "step time s"), ("samples_per_s", "samples/s"),
           ("tokens_per_s", "tokens/s"), ("tflops_per_gpu", "TFLOP/s/GPU"), ("mfu", "MFU"),
           ("peak_memory_gb", "peak memory GB"), ("loss", "loss first -> last")]


def _parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="mega bench train",
        description="Baseline report: a short `mega train` per precision (fp32, fp16, bf16, fp8 where "
                    "available) with step time, samples/s, tokens/s, TFLOP/s, MFU and peak memory, and the "
                    "environment from `mega doctor`. Every other flag is passed to `mega train`.")
    parser.add_argument("--precisions", default="fp32,fp16,bf16,fp8",
                        help="comma-separated, of fp32, fp16, bf16, fp8 (default: all; fp8 is skipped, with "
                             "the reason, where no backend offers it)")
    parser.add_argument("--warmup-iters", "--warmup", type=int, default=2, dest="warmup",
                        help="first steps left out of the figures (default 2; spelled as `mega bench comm`'s)")
    parser.add_argument("--output", default="bench-train",
                        help="write OUTPUT.md and OUTPUT.json (default bench-train)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes per run (default 1)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of markdown")
    parser.add_argument("--one-run", metavar="RESULT_JSON", help=argparse.SUPPRESS)  # a worker's own run
    return parser


@dataclass
class StepRecorder:
    """Listens to one run: step times after the warm-up, losses, peak memory."""

    warmup: int
    step_times: list[float] = field(default_factory=list)

    @hookimpl
    def on_step_end(self, run, iteration, metrics):
        if iteration > self.warmup:
            self.step_times.append(metrics["elapsed_s"])

    def result(self, run) -> dict:
        if not self.step_times:
            raise ValueError(f"--train-iters must exceed --warmup-iters {self.warmup} to time any step")
        step = statistics.median(self.step_times)
        world = run.groups.world_size
        tokens = run.derived.global_batch_size * run.config.model.seq_length
        tflops = run.flops_per_iteration / step / world / 1e12
        peak = peak_tflops(run.groups.device, model_dtype(run.config.precision), run.config.logging.peak_tflops)
        return {"step_time_s": step, "samples_per_s": run.derived.global_batch_size / step,
                "tokens_per_s": tokens / step, "tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None,
                "peak_memory_gb": peak_memory_gb(run.groups.device), "timed_steps": len(self.step_times),
                "loss_first": run.losses[0], "loss_last": run.losses[-1], "world_size": world,
                "device": str(run.groups.device)}


def _one_run(argv: list[str], result_path: str, warmup: int) -> int:
    """A worker: train with ``argv`` in this process (one rank) and write rank 0's figures."""
    plugins = get_plugins()
    run, family = parse_run(argv, plugins)
    init_distributed()
    # The launcher's stdout is the report's: a run's log lines are progress, for stderr.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            run, derived = derive(run, dist.get_world_size() if dist.is_initialized() else 1)
            groups = ParallelGroups(run.parallel)
            run, data = build_datasets(run, derived, plugins)
            trainer = Trainer(run, derived, family, plugins, data, groups)
            recorder = StepRecorder(warmup)
            trainer.events.add(recorder)
            state = trainer.train()
            if groups.global_rank == 0:
                Path(result_path).write_text(json.dumps(recorder.result(state)))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


def unavailable_reason(train_argv: list[str], precision: str) -> str | None:
    """Why this installation cannot train in ``precision`` (fp8 without Transformer Engine...), or None.

    ``train_argv`` must parse (checked first): only what the precision adds is judged here.
    """
    run, _ = parse_run(train_argv + PRECISION_FLAGS[precision])
    try:
        check_supported(run)
    except ConfigError as error:
        return str(error)
    return None


def markdown(report: dict) -> str:
    env = report["environment"]
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in env["gpus"]) or "none (CPU)"
    lines = [
        "# mega bench train", "",
        f"- command: `mega bench train {' '.join(report['argv'])}`",
        f"- Python {env['python']}, torch {env['torch']}, CUDA runtime {env['cuda_runtime'] or 'none'}, "
        f"{env['cpu_count']} CPU cores, {env['platform']}",
        f"- GPUs: {gpus}",
        f"- packages: {', '.join(f'{k} {v}' for k, v in sorted(env['packages'].items()))}",
        f"- medians over steps after the first {report['warmup']}, {report['nproc_per_node']} process(es) per run",
        "",
        "| " + " | ".join(title for _, title in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in report["runs"]:
        if "skipped" in row:
            lines.append(f"| {row['precision']} | skipped: {row['skipped']} |" + " |" * (len(COLUMNS) - 2))
            continue
        cells = [row["precision"], f"{row['step_time_s']:.4f}", f"{row['samples_per_s']:,.1f}",
                 f"{row['tokens_per_s']:,.0f}", f"{row['tflops_per_gpu']:.3f}",
                 f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a (peak unknown)",
                 f"{row['peak_memory_gb']:.2f}", f"{row['loss_first']:.3f} -> {row['loss_last']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args, train_argv = _parser().parse_known_args(argv)
    if args.one_run:
        return _one_run(train_argv, args.one_run, args.warmup)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in PRECISION_FLAGS]
    if unknown:
        print(f"mega bench train: error: --precisions: unknown {', '.join(unknown)}; choose from "
              f"{', '.join(PRECISION_FLAGS)}", file=sys.stderr)
        return 2
    try:
        check_supported(parse_run(train_argv)[0])  # the flags every run shares must be right
    except (ConfigError, PluginError, KeyError) as error:
        print(f"mega bench train: error: {error}", file=sys.stderr)
        return 2
    runs = []
    with tempfile.TemporaryDirectory(prefix="mega-bench-train-") as scratch:
        for precision in precisions:
            reason = unavailable_reason(train_argv, precision)
            if reason:
                runs.append({"precision": precision, "skipped": reason})
                continue
            result = Path(scratch) / f"{precision}.json"
            command = ["bench", "train", "--one-run", str(result), "--warmup-iters", str(args.warmup),
                       *train_argv, *PRECISION_FLAGS[precision]]
            print(f"mega bench train: {precision} ...", file=sys.stderr, flush=True)
            code = launch_local(args.nproc_per_node, command)
            if code != 0 or not result.exists():
                print(f"mega bench train: error: the {precision} run failed (exit code {code})", file=sys.stderr)
                return code or 1
            runs.append({"precision": precision, **json.loads(result.read_text())})
    _, facts = run_checks()
    report = {"argv": argv, "warmup": args.warmup, "nproc_per_node": args.nproc_per_node,
              "environment": facts, "runs": runs}
    text, report_json = markdown(report), json.dumps(report, indent=2) + "\n"
    Path(f"{args.output}.md").write_text(text)
    Path(f"{args.output}.json").write_text(report_json)
    print(report_json if args.json else text, end="")
    print(f"mega bench train: wrote {args.output}.md and {args.output}.json", file=sys.stderr)
    return 0
