"""MFU of `mega train` on one GPU: GPT ~1.3B, sequence 2048, bf16 (the issue's target: >= 45% on an H100).

Runs the real training loop (mock data, Megatron's FLOPs formula) and reports the median step
time, tokens/s, achieved TFLOP/s and MFU against the device's dense bf16 peak. Needs a CUDA
device; on a machine without one it says so and exits without a figure.

    python benchmarks/bench_gpu_mfu.py                      # gpt 1.3b preset, micro-batch 4
    python benchmarks/bench_gpu_mfu.py --micro-batch-size 8 --recompute selective --json
    python benchmarks/bench_gpu_mfu.py --json --kernels liger          # any further mega train flags
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from mega.core.plugins import hookimpl, load_plugins
from mega.core.training.command import parse_run
from mega.core.training.device_peaks import peak_tflops
from mega.core.training.launch_run import run_training


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="1.3b")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    parser.add_argument("--json", action="store_true")
    # Flags this script does not know go to `mega train` as they are (--kernels, --model-family...).
    args, train_flags = parser.parse_known_args()
    if not torch.cuda.is_available():
        print("bench_gpu_mfu: no CUDA device here; this benchmark needs a GPU (nothing measured)")
        return 0

    seconds: list[float] = []

    class Recorder:
        @hookimpl
        def register_callbacks(self, register):
            class Listener:
                @hookimpl
                def on_step_end(self, metrics):
                    seconds.append(metrics["elapsed_s"])
            register("bench-mfu", lambda run_config: Listener())

    argv = ["--model-preset", args.preset, "--seq-length", str(args.seq_length),
            "--max-position-embeddings", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.steps), "--bf16",
            "--mock-data", "--eval-iters", "0", "--log-interval", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--split", "100,0,0"]
    if args.recompute != "none":
        argv += ["--recompute-granularity", args.recompute]
        if args.recompute == "full":
            argv += ["--recompute-method", "uniform", "--recompute-num-layers", "1"]
    argv += train_flags
    plugins = load_plugins(extra=[("bench", Recorder())])
    run, family = parse_run(argv, plugins)
    state = run_training(run, family, plugins)

    step = statistics.median(seconds[2:])  # the first steps pay for allocation and autotuning
    tflops = state.flops_per_iteration / step / 1e12
    peak = peak_tflops(torch.device("cuda"), torch.bfloat16)
    result = {
        "device": torch.cuda.get_device_name(), "preset": args.preset, "seq_length": args.seq_length,
        "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
        "train_flags": " ".join(train_flags),
        "parameters": family.num_parameters(run.model), "step_s": step,
        "tokens_per_s": args.global_batch_size * args.seq_length / step, "tflops": tflops,
        "peak_tflops": peak, "mfu": tflops / peak if peak else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
    }
    print(json.dumps(result, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
