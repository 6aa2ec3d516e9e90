"""Per-rank bytes under each data-parallel sharding strategy, measured beside `mega plan`'s estimate.

Builds a GPT (by default 4 layers, hidden 256, untied output layer) with `mega train`'s own Trainer on dp gloo ranks
(CPU), takes one step, and measures on every rank what it holds (its parameters' storage, FSDP's
local shards or DDP's whole parameters; its gradients; its optimizer state), what one
micro-batch's forward saves for backward, and under FSDP the most it gathers at once (units and
unreduced gradients), as mega.train.testing.memory_check does for tests/test_plan_vs_training.py;
then asks the planner (mega.train.planning.memory_plan) for the same run. ZeRO-3
(optim_grads_params) should hold about 1/dp of no_shard's weights + gradients + optimizer (the
acceptance of issue 32: within 5% at dp4), and the planner's peak should be within 10% of the
measured one.

    python benchmarks/bench_fsdp_memory.py [--dp 4] [--bf16] [--json]
"""

from __future__ import annotations

import argparse
import json

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
STATE = ("weights", "gradients", "optimizer")
PEAK = (*STATE, "gathered", "activations")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from mega.testing import DistributedWorld
    from mega.train.testing.memory_check import measured_and_planned

    argv = ["--mock-data", "--model-preset", "tiny", "--num-layers", str(args.layers), "--hidden-size",
            str(args.hidden), "--num-attention-heads", "8", "--seq-length", "64", "--max-position-embeddings", "64",
            "--micro-batch-size", "1", "--train-iters", "1", "--eval-iters", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-interval", "100",
            # Untied: a tied output layer's gradient waits inside autograd, unseen by the measurement.
            "--untie-embeddings-and-output-weights"] + (["--bf16"] if args.bf16 else [])
    rows = []
    with DistributedWorld(args.dp, timeout_s=900) as world:
        for strategy in STRATEGIES:
            per_rank = world.run(measured_and_planned, argv + ["--data-parallel-sharding-strategy", strategy])
            worst = max(per_rank, key=lambda rank: sum(rank["measured"].values()))
            measured, planned = worst["measured"], worst["planned"]
            rows.append({"strategy": strategy, **{key: measured.get(key, 0) for key in PEAK},
                         "state": sum(measured[key] for key in STATE), "peak": sum(measured.values()),
                         "planned_peak": sum(planned.values()), "planned": planned})
    for row in rows:
        row["state_vs_no_shard"] = row["state"] / rows[0]["state"]
    print(json.dumps(rows, indent=2) if args.json else markdown(rows, args))
    return 0


def markdown(rows: list[dict], args) -> str:
    """The rows as docs/fsdp.md's table (MiB per rank)."""
    title = (f"dp{args.dp}, GPT {args.layers} layers x hidden {args.hidden}, {'bf16' if args.bf16 else 'fp32'}, "
             f"AdamW, micro-batch 1 x seq 64; MiB per rank (1/dp = {1 / args.dp:.3f})")
    lines = [title, "", "| strategy | weights | gradients | optimizer | w+g+o x no_shard | gathered | activations "
             "| peak measured | peak planned | planned / measured |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [row["strategy"], *(_mib(row[key]) for key in STATE), f"{row['state_vs_no_shard']:.3f}",
                 _mib(row["gathered"]), _mib(row["activations"]), _mib(row["peak"]), _mib(row["planned_peak"]),
                 f"{row['planned_peak'] / row['peak']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mib(value: int) -> str:
    return f"{value / 2**20:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
