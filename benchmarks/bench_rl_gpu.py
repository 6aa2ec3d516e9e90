"""A GRPO step of `mega rl` at the LLaMA 1.2B shape on one GPU: the phases, the rollout's tokens/s
against the engine alone, the weight refresh and the peak memory (issue 48's GPU command).

One process, one GPU, bf16: mega's trainer (``PolicyEngine``, AdamW) and its engine
(``build_rollout_engine``) hold the LLaMA 1.2B shape of gpu-h200.md (16 layers, hidden 2048, ffn
8192, 32 heads, 8 query groups, vocabulary 128,256); random weights and random prompts, so the
reward (the fraction of completion tokens below 1,000) only gives the loss something to do. Each
of ``--steps`` GRPO steps (after a warm-up step) reports rollout, log-probabilities, update and
refresh seconds, rollout tokens/s and the peak memory of the step. Then the engine alone: the
same requests through the one decoder loop on the static KV cache (CUDA graphs), as ``mega
generate`` runs them, without the trainer's optimizer state beside it; the ratio says what
running inside the training job costs the rollout.

``--own-engine`` gives the engine a model of its own, refreshed from the trainer after every
update (the path of a training layout the engine does not share), so ``refresh_s`` is measured;
without it the engine generates from the trainer's parameters and the refresh is 0.

    python benchmarks/bench_rl_gpu.py --json                     # on the GPU machine (gpu_suite row rl-step)
    python benchmarks/bench_rl_gpu.py --own-engine --json        # with the refresh
    python benchmarks/bench_rl_gpu.py --device cpu --layers 2 --hidden 64 --heads 4 --query-groups 4 \\
        --ffn 128 --vocab 512 --prompts 2 --group 2 --prompt-len 8 --new-tokens 8 --dtype float32   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--query-groups", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="steps timed after one warm-up step")
    parser.add_argument("--own-engine", action="store_true",
                        help="the engine on a model of its own, refreshed after every update (times the refresh)")
    parser.add_argument("--json", action="store_true")
    return parser


def policy_flags(args) -> list[str]:
    """`mega train`'s flags of the policy: the shape, bf16 (or fp32), AdamW, the whole step's
    completions in one optimizer step."""
    sequences = args.prompts * args.group
    length = args.prompt_len + args.new_tokens
    flags = ["--model-family", "llama", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--ffn-hidden-size", str(args.ffn), "--num-attention-heads", str(args.heads),
             "--num-query-groups", str(args.query_groups), "--seq-length", str(length),
             "--max-position-embeddings", str(length), "--vocab-size", str(args.vocab),
             "--untie-embeddings-and-output-weights", "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(sequences), "--lr", "1e-6", "--lr-decay-style", "constant",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "1000", "--eval-iters", "0"]
    return flags + (["--bf16"] if args.dtype == "bfloat16" else [])


def peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_rl_gpu: no CUDA device here (give --device cpu for a smoke run); nothing measured")
        return 0
    from mega.inference.engine import GenerationRequest
    from mega.inference.engine.continuous import ContinuousBatchingWorker
    from mega.inference.engine.sampling import SamplingParams
    from mega.rl.grpo_step import GRPOSettings, grpo_step
    from mega.rl.policy_engine import PolicyEngine
    from mega.rl.rollouts import RolloutSampling, build_rollout_engine

    if args.device == "cpu":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    policy = PolicyEngine.from_args(policy_flags(args))
    device = policy.groups.device
    engine = build_rollout_engine(policy, own_model=args.own_engine)
    sequences = args.prompts * args.group
    settings = GRPOSettings(group_size=args.group, global_batch_size=sequences)
    sampling = RolloutSampling(max_new_tokens=args.new_tokens, seed=0)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab, (args.prompt_len,), generator=generator).tolist()
               for _ in range(args.prompts)]

    def reward(rollouts):
        return torch.tensor([sum(t < 1000 for t in c) / max(len(c), 1) for c in rollouts.completions])

    steps = []
    for step in range(args.steps + 1):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        log = grpo_step(policy, engine, prompts, reward, settings, sampling, step_seed=step * 2**20)
        log["step_s"] = time.perf_counter() - start
        log["peak_memory_gb"] = peak_gb(device)
        if step:  # the first is the warm-up (allocation, autotuning)
            steps.append(log)

    # The engine alone: the same requests (sampled at temperature 1, each its own seed) through
    # the one loop on the static cache, CUDA graphs on a GPU, as `mega generate` runs them.
    requests = [GenerationRequest(prompt=list(p), max_new_tokens=args.new_tokens,
                                  sampling=SamplingParams(temperature=1.0, seed=i))
                for i, p in enumerate(q for q in prompts for _ in range(args.group))]
    worker = ContinuousBatchingWorker(engine.engine, max_batch_size=sequences,
                                      max_num_tokens=sequences * (args.prompt_len + args.new_tokens),
                                      static_cache=True)
    engine.model.eval()
    rates = []
    for repeat in range(2):
        start = time.perf_counter()
        results = worker.run_to_completion(requests)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if repeat:  # the first captures the graphs
            rates.append(sum(len(r.generated) for r in results) / (time.perf_counter() - start))

    phases = ("rollout_s", "logprobs_s", "update_s", "refresh_s", "step_s")
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": {"layers": args.layers, "hidden": args.hidden, "ffn": args.ffn, "heads": args.heads,
                  "query_groups": args.query_groups, "vocab": args.vocab},
        "dtype": args.dtype, "prompts": args.prompts, "group": args.group, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "own_engine": args.own_engine,
        **{name: statistics.median(log[name] for log in steps) for name in phases},
        "rollout_tokens_per_s": statistics.median(log["rollout_tokens_per_s"] for log in steps),
        "engine_alone_tokens_per_s": statistics.median(rates),
        "peak_memory_gb": max((log["peak_memory_gb"] or 0.0) for log in steps) or None,
        "response_length": statistics.mean(log["response_length"] for log in steps),
    }
    result["rollout_of_engine_alone"] = result["rollout_tokens_per_s"] / result["engine_alone_tokens_per_s"]
    print(json.dumps(result, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
