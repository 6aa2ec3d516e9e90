"""Muon against AdamW: loss curves, step time and the optimizer step's share of it (issue 51).

Both runs are ordinary `mega train` runs in this process with the same model, data, seed, steps
and tokens; only ``--optimizer`` (and Muon's flags) differ. Muon uses Moonlight's AdamW-RMS
matching (``--muon-scale-mode spectral --muon-extra-scale-factor 0.2``), so it takes AdamW's
learning rate and weight decay unchanged.

CPU (default): the demo GPT (4 layers, hidden 128) on the embedded pydoc-topics corpus, the data
`mega train` with no arguments trains on. ``--gpu``: GPT 1.3B (24 layers, hidden 2048, 16 heads,
sequence 2048, bf16, mock data) on one GPU: how much of a step the Newton-Schulz iterations take.

    python benchmarks/bench_optimizers.py --iters 60
    python benchmarks/bench_optimizers.py --gpu --iters 20 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mega.core.optim.optimizer import MixedPrecisionOptimizer
from mega.train import trainer as trainer_module
from mega.train.default_run import MODEL_FLAGS
from mega.train.launch_run import run_training
from mega.train.run_parser import parse_run

CPU_FLAGS = ["--dataset", "pydoc-topics", "--split", "95,5,0", *MODEL_FLAGS, "--micro-batch-size", "16",
             "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "10", "--lr-decay-style", "cosine",
             "--weight-decay", "0.1", "--clip-grad", "1.0", "--eval-iters", "0", "--seed", "1234"]
GPU_FLAGS = ["--mock-data", "--model-family", "gpt", "--num-layers", "24", "--hidden-size", "2048",
             "--num-attention-heads", "16", "--seq-length", "2048", "--max-position-embeddings", "2048",
             "--micro-batch-size", "4", "--global-batch-size", "4", "--bf16", "--lr", "3e-4",
             "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1.0", "--eval-iters", "0",
             "--seed", "1234"]
OPTIMIZERS = {
    "adamw": ["--optimizer", "adam"],
    "muon": ["--optimizer", "muon", "--muon-momentum", "0.95", "--muon-use-nesterov", "--muon-scale-mode", "spectral",
             "--muon-extra-scale-factor", "0.2"],
}


class Timings:
    """Wall time of every train step and of every optimizer step (device-synchronised)."""

    def __init__(self):
        self.step, self.optimizer = [], []

    def wrap(self, owner, name: str, into: list[float]):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            sync()
            start = time.perf_counter()
            result = original(*args, **kwargs)
            sync()
            into.append(time.perf_counter() - start)
            return result

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(name: str, flags: list[str], iters: int, warmup: int) -> dict:
    timings = Timings()
    restores = [timings.wrap(trainer_module.Trainer, "train_step", timings.step),
                timings.wrap(MixedPrecisionOptimizer, "step", timings.optimizer)]
    try:
        args, family = parse_run([*flags, *OPTIMIZERS[name], "--train-iters", str(iters), "--log-interval",
                                  str(max(iters // 4, 1))])
        losses = run_training(args, family).losses
    finally:
        for restore in restores:
            restore()
    steps, optimizer = timings.step[warmup:], timings.optimizer[warmup:]
    step_ms, optimizer_ms = statistics.median(steps) * 1e3, statistics.median(optimizer) * 1e3
    return {"optimizer": name, "losses": losses, "step_ms": step_ms, "optimizer_step_ms": optimizer_ms,
            "optimizer_share": optimizer_ms / step_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", action="store_true", help="GPT 1.3B in bf16 on one GPU (mock data)")
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timings")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    flags = GPU_FLAGS if args.gpu else CPU_FLAGS
    warmup_iters = int(flags[flags.index("--lr-warmup-iters") + 1])
    if args.iters <= max(warmup_iters, args.warmup):
        parser.error(f"--iters must exceed the learning-rate warm-up ({warmup_iters}) and --warmup ({args.warmup})")
    results = [run(name, flags, args.iters, args.warmup) for name in OPTIMIZERS]
    if args.json:
        print(json.dumps({"optimizers": results}))
        return
    marks = sorted({0, *range(args.iters // 6, args.iters, max(args.iters // 6, 1)), args.iters - 1})
    print("\n| optimizer | step (ms, median) | optimizer step (ms) | share of the step | "
          + " | ".join(f"loss @{m + 1}" for m in marks) + " |")
    print("|---|---|---|---|" + "---|" * len(marks))
    for r in results:
        print(f"| {r['optimizer']} | {r['step_ms']:.1f} | {r['optimizer_step_ms']:.2f} | {r['optimizer_share']:.1%} | "
              + " | ".join(f"{r['losses'][m]:.3f}" for m in marks) + " |")


if __name__ == "__main__":
    main()
