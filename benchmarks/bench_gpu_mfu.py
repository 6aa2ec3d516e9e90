"""MFU of `mega train` on one GPU: one table per model (GPT 1.3B, the LLaMA 1.2B shape), sequence 2048, bf16.

Runs the real training loop (mock data, Megatron's FLOPs formula) and reports the median step
time, tokens/s, achieved TFLOP/s, MFU against the device's dense bf16 peak (as Megatron reports)
and peak memory. Needs a CUDA device; on a machine without one it says so and exits without a
figure.

    python benchmarks/bench_gpu_mfu.py                      # the tables (also `nox -s bench -- gpu_mfu`)
    python benchmarks/bench_gpu_mfu.py --table --models gpt # one model's table
    python benchmarks/bench_gpu_mfu.py --json               # one run: gpt 1.3b preset, micro-batch 4
    python benchmarks/bench_gpu_mfu.py --micro-batch-size 8 --recompute selective --json
    python benchmarks/bench_gpu_mfu.py --json --kernels liger          # any further mega train flags
    python benchmarks/bench_gpu_mfu.py --json --hf llama    # Hugging Face's model of the same shape
    python benchmarks/bench_gpu_mfu.py --json --use-torch-fsdp2   # FSDP2 (ZeRO-3) on one GPU: its overhead over DDP

A table has a row per configuration: torch kernels, --compile, --kernels liger, FP8 through
torchao (tensorwise, rowwise: compiled, mega train's default for FP8 on a GPU; tensorwise with
--no-compile), FSDP2 (--use-torch-fsdp2, ZeRO-3 over a
one-process group: what sharding costs where nothing is sharded) and Hugging Face transformers' model of the
same shape (sdpa attention, bf16 autocast over fp32 weights, fused AdamW). Each row is its own
child process (a fresh CUDA context, so peak memory is the run's own); a row that fails shows
the last line of its error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from mega.core.plugins import hookimpl, load_plugins
from mega.core.process_group import distributed_env
from mega.train.command import parse_run
from mega.train.device_peaks import peak_tflops
from mega.train.launch_run import run_training

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_profile import StepProfiler, as_json, markdown  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="1.3b")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--table", action="store_true", help="the tables (the default without mega train flags)")
    parser.add_argument("--models", default="gpt,llama", help="the tables' models: gpt, llama")
    parser.add_argument("--hf", choices=list(MODELS), help="one run of Hugging Face's model of this shape")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile the last N steps (torch profiler): the kernel table by time, by category "
                             "(gemm, fp8 gemm, fp8 cast/amax, attention, copies...); the steps before give the timing")
    return parser


def check_flags(argv: list[str]) -> None:
    """Parse ``argv`` as a run would, mega train's flags included, and measure nothing (the GPU
    suite's dry run, on any machine): a flag either parser refuses exits non-zero."""
    args, train_flags = build_parser().parse_known_args(argv)
    if not (args.table or args.hf or not (train_flags or args.json)):
        parse_run(train_argv(args) + train_flags, load_plugins())


def main() -> int:
    # Flags this script does not know go to `mega train` as they are (--kernels, --model-family...).
    args, train_flags = build_parser().parse_known_args()
    if not torch.cuda.is_available():
        print("bench_gpu_mfu: no CUDA device here; this benchmark needs a GPU (nothing measured)")
        return 0
    if args.table or not (train_flags or args.json or args.hf):
        return print_tables(args)
    if args.hf:
        result = hf_run(args)
        print(json.dumps(result, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
        return 0

    seconds: list[float] = []
    timed_steps = args.steps - args.profile
    if args.profile and timed_steps < 4:
        raise SystemExit(f"--profile {args.profile} needs --steps >= {args.profile + 4} (4 steps to time)")
    profiler, kernels = StepProfiler(), []

    class Recorder:
        @hookimpl
        def register_callbacks(self, register):
            class Listener:
                @hookimpl
                def on_step_end(self, metrics):
                    seconds.append(metrics["elapsed_s"])
                    if args.profile and len(seconds) == timed_steps:
                        profiler.start()
                    elif args.profile and len(seconds) == args.steps:
                        kernels.extend(profiler.stop(args.profile))
            register("bench-mfu", lambda run_config: Listener())

    argv = train_argv(args) + train_flags
    if FSDP_FLAGS & set(train_flags) and distributed_env() is None:
        # FSDP2 shards over a process group, even of one GPU: join a one-process group.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    plugins = load_plugins(extra=[("bench", Recorder())])
    run, family = parse_run(argv, plugins)
    state = run_training(run, family, plugins)

    step = statistics.median(seconds[2:timed_steps])  # the first steps pay for allocation and autotuning
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
    if kernels:
        result["kernels"] = as_json(kernels)
        print(markdown(kernels), file=sys.stderr)  # the JSON on stdout stays one document
    print(json.dumps(result, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


def train_argv(args) -> list[str]:
    """`mega train`'s flags for the script's settings."""
    argv = ["--model-preset", args.preset, "--seq-length", str(args.seq_length),
            "--max-position-embeddings", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.steps), "--bf16",
            "--mock-data", "--eval-iters", "0", "--log-interval", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--split", "100,0,0"]
    if args.recompute != "none":
        argv += ["--recompute-granularity", args.recompute]
        if args.recompute == "full":
            argv += ["--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return argv


# The tables' models: the script's flags for each (gpu-h200.md's LLaMA shape: 1.50B parameters
# with the untied 128,256-token vocabulary).
MODELS = {
    "gpt": ("GPT 1.3B", "1.3b", []),
    "llama": ("LLaMA 1.2B shape (16 layers, h 2048, ffn 8192, 32/8 heads, vocab 128256)", "llama3-8b",
              ["--model-family", "llama", "--num-layers", "16", "--hidden-size", "2048", "--ffn-hidden-size", "8192",
               "--num-attention-heads", "32", "--num-query-groups", "8"]),
}
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe"]
FSDP_FLAGS = {"--use-torch-fsdp2", "--data-parallel-sharding-strategy"}
CONFIGURATIONS = {
    "torch kernels": [],
    "--compile": ["--compile"],
    "--kernels liger": ["--kernels", "liger"],
    "--kernels liger --compile": ["--kernels", "liger", "--compile"],
    # FP8 on a GPU compiles by default (mega train's --compile default); --no-compile shows why.
    "fp8 tensorwise": [*FP8, "tensorwise"],
    "fp8 rowwise": [*FP8, "rowwise"],
    "fp8 tensorwise --no-compile": [*FP8, "tensorwise", "--no-compile"],
    "FSDP2 (--use-torch-fsdp2)": ["--use-torch-fsdp2"],
}


def print_tables(args) -> int:
    """One markdown table per model, each row a child process of this script."""
    common = ["--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
              "--global-batch-size", str(args.global_batch_size), "--steps", str(args.steps),
              "--recompute", args.recompute]
    for model in args.models.split(","):
        title, preset, flags = MODELS[model]
        rows = [(name, ["--preset", preset, *flags, *common, *extra]) for name, extra in CONFIGURATIONS.items()]
        rows.append(("Hugging Face transformers", ["--hf", model, *common]))
        print(f"\n### {title}: seq {args.seq_length}, micro-batch {args.micro_batch_size} x "
              f"{args.global_batch_size // args.micro_batch_size}, bf16\n", flush=True)
        print("| configuration | tokens/s | MFU | peak GB | flags |\n|---|---|---|---|---|", flush=True)
        baseline = None
        for name, argv in rows:
            result = _child(argv)
            if "error" in result:
                print(f"| {name} | failed: {result['error']} | | | `{' '.join(argv)}` |", flush=True)
                continue
            baseline = baseline or result["tokens_per_s"]
            mfu = f"{result['mfu']:.1%}" if result.get("mfu") else ""
            print(f"| {name} | {result['tokens_per_s'] / 1e3:.1f}k ({result['tokens_per_s'] / baseline:.2f}x) | "
                  f"{mfu} | {result['peak_memory_gb']:.1f} | `{' '.join(argv)}` |", flush=True)
    return 0


def _child(argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, __file__, "--json", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit status {done.returncode}"}
    return json.loads(done.stdout[done.stdout.index("{\n"):])


def hf_run(args) -> dict:
    """Hugging Face's model of the table's shape trained the usual way: sdpa attention, bf16
    autocast over fp32 weights, fused AdamW; the FLOPs are mega's formula for the same shape."""
    import transformers

    _, preset, flags = MODELS[args.hf]
    run, family = parse_run(train_argv(argparse.Namespace(**{**vars(args), "preset": preset})) + flags)
    model = run.model
    if args.hf == "gpt":
        config = transformers.GPT2Config(n_embd=model.hidden_size, n_layer=model.num_layers,
                                         n_head=model.num_attention_heads, n_positions=args.seq_length,
                                         vocab_size=model.vocab_size, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        module = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(hidden_size=model.hidden_size, intermediate_size=model.ffn_hidden_size,
                                          num_hidden_layers=model.num_layers,
                                          num_attention_heads=model.num_attention_heads,
                                          num_key_value_heads=model.num_query_groups, vocab_size=model.vocab_size,
                                          max_position_embeddings=args.seq_length, rope_theta=model.rotary_base)
        module = transformers.LlamaForCausalLM(config)
    module.config._attn_implementation = "sdpa"
    module = module.cuda().train()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
    accumulation = args.global_batch_size // args.micro_batch_size
    tokens = torch.randint(0, model.vocab_size, (args.micro_batch_size, args.seq_length), device="cuda")
    seconds = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(accumulation):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = module(input_ids=tokens, labels=tokens).loss / accumulation
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    step = statistics.median(seconds[2:])
    tflops = family.num_floating_point_operations(model, args.global_batch_size) / step / 1e12
    peak = peak_tflops(torch.device("cuda"), torch.bfloat16)
    return {"device": torch.cuda.get_device_name(), "model": f"transformers {type(module).__name__}",
            "step_s": step, "tokens_per_s": args.global_batch_size * args.seq_length / step, "tflops": tflops,
            "peak_tflops": peak, "mfu": tflops / peak if peak else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9}


if __name__ == "__main__":
    sys.exit(main())
