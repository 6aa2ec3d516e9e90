"""The gated delta rule (Qwen3-Next's linear attention): mega's chunked and recurrent torch
implementations against transformers' torch ones, forward and backward, on the same inputs.

    python benchmarks/bench_gated_delta_rule.py [--batch 1] [--seq 2048] [--heads 8] [--repeats 5]
    python benchmarks/bench_gated_delta_rule.py --device cuda --seq 8192 --heads 32

One process, fp32. Queries and keys are L2-normalised (transformers normalises them inside, mega
before the call: both timed with it), head sizes 128 as Qwen3-Next's, chunks of 64. Each row is
the median of ``--repeats`` calls after a warm-up, the calls of the implementations alternating;
the outputs and final states are checked equal to the recurrent rule's (1e-4 relative: fp32 over
thousands of steps). The recurrent rules run over ``--recurrent-seq`` tokens only (a Python loop
per token; what decoding runs one token at a time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from mega.models.qwen3_next.delta_rule import (  # noqa: E402
    chunked_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)

KEY = VALUE = 128


def inputs(batch: int, heads: int, seq: int, device: torch.device):
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device)

    query, key = randn(batch, heads, seq, KEY), randn(batch, heads, seq, KEY)
    value = randn(batch, heads, seq, VALUE)
    g = -torch.rand(batch, heads, seq, generator=generator, device=device)
    beta = torch.rand(batch, heads, seq, generator=generator, device=device)
    return [t.requires_grad_() for t in (query, key, value, g, beta)]


def ours(rule):
    def run(query, key, value, g, beta):
        query, key = l2_normalize(query) * KEY ** -0.5, l2_normalize(key)
        return rule(query, key, value, g, beta)
    return run


def theirs(rule):
    def run(query, key, value, g, beta):
        out, state = rule(*(t.transpose(1, 2) for t in (query, key, value)), g=g.transpose(1, 2),
                          beta=beta.transpose(1, 2), output_final_state=True, use_qk_l2norm_in_kernel=True)
        return out.transpose(1, 2), state
    return run


def timed(fn, args, device) -> float:
    start = time.perf_counter()
    out, state = fn(*args)
    (out.sum() + state.sum()).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def compare(implementations: dict, args, device, repeats: int) -> dict[str, float]:
    for fn in implementations.values():
        timed(fn, args, device)  # warm-up
    times = {name: [] for name in implementations}
    for _ in range(repeats):
        for name, fn in implementations.items():
            times[name].append(timed(fn, args, device))
    return {name: statistics.median(values) for name, values in times.items()}


def check(implementations: dict, args, reference: str) -> None:
    with torch.no_grad():
        results = {name: fn(*args) for name, fn in implementations.items()}
    expected_out, expected_state = results[reference]
    for name, (out, state) in results.items():
        for got, want in ((out, expected_out), (state, expected_state)):
            error = ((got - want).abs().max() / want.abs().max()).item()
            assert error < 1e-4, f"{name}: relative error {error:.2e} against {reference}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--recurrent-seq", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    print(f"gated delta rule, fp32, {device.type}, batch {args.batch}, {args.heads} heads of {KEY}x{VALUE}, "
          f"forward + backward, median of {args.repeats}")
    print(f"{'implementation':44s} {'tokens':>7s} {'ms':>10s} {'vs transformers':>16s}")
    for kind, seq, mega_rule, hf_rule in (
            ("chunked (64)", args.seq, chunked_gated_delta_rule, hf.torch_chunk_gated_delta_rule),
            ("recurrent", args.recurrent_seq, recurrent_gated_delta_rule, hf.torch_recurrent_gated_delta_rule)):
        tensors = inputs(args.batch, args.heads, seq, device)
        implementations = {f"mega {kind}": ours(mega_rule), f"transformers {kind}": theirs(hf_rule)}
        check({**implementations, "recurrent": ours(recurrent_gated_delta_rule)} if seq <= args.recurrent_seq
              else implementations, tensors, "recurrent" if seq <= args.recurrent_seq else f"transformers {kind}")
        medians = compare(implementations, tensors, device, args.repeats)
        base = medians[f"transformers {kind}"]
        for name, seconds in medians.items():
            print(f"{name:44s} {seq:7d} {seconds * 1e3:10.1f} {base / seconds:15.2f}x")


if __name__ == "__main__":
    main()
