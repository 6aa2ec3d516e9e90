"""Per-rank bytes of weights, gradients and optimizer state under each data-parallel sharding strategy.

Builds a GPT (by default 8 layers, hidden 512) with `mega train`'s own Trainer on dp gloo ranks
(CPU), takes one step, and counts what this rank holds between steps: its parameters' storage
(FSDP's local shards, or DDP's whole parameters), its gradients (FSDP's sharded gradients, or DDP's
buffers) and its optimizer state (Adam moments, fp32 main copies). ZeRO-3 (optim_grads_params)
should hold about 1/dp of the unsharded total (the acceptance of issue 32: within 5% at dp4).

    python benchmarks/bench_fsdp_memory.py [--dp 4] [--bf16] [--json]
"""

from __future__ import annotations

import argparse
import json

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
COLUMNS = ("weights", "gradients", "optimizer", "total")


def held_bytes(argv: list[str]) -> dict:
    import torch.distributed as dist

    from mega.core.parallel import ParallelGroups
    from mega.core.parallel.local_shard import local
    from mega.core.plugins import get_plugins
    from mega.core.training.command import parse_run
    from mega.core.training.data_setup import build_datasets
    from mega.core.training.run_config import derive
    from mega.core.training.trainer import Trainer

    plugins = get_plugins()
    run, family = parse_run(argv)
    run, derived = derive(run, dist.get_world_size() if dist.is_initialized() else 1)
    groups = ParallelGroups(run.parallel)
    run, data = build_datasets(run, derived, plugins)
    trainer = Trainer(run, derived, family, plugins, data, groups)
    for chunk in trainer.chunks:
        chunk.zero_grad_buffer()
    trainer._run_schedule(trainer._microbatches(trainer.train_data, 0), forward_only=False)
    params = {id(p): p for chunk in trainer.chunks for p in chunk.parameters()}.values()
    storages = {}
    for param in params:
        storage = local(param.data).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    buffers = [b for chunk in trainer.chunks for b in getattr(chunk, "grad_buffers", [])]
    # Counted before the step, which drops FSDP's gradients (DDP's buffers stay).
    gradients = (sum(b.grad_data.nbytes for b in buffers) if buffers else
                 sum(local(p.grad).nbytes for p in params if p.grad is not None))
    trainer.optimizer.step()
    return {"weights": sum(storages.values()), "gradients": gradients, "optimizer": trainer.optimizer.state_bytes()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from mega.core.testing import DistributedWorld

    argv = ["--mock-data", "--model-preset", "tiny", "--num-layers", str(args.layers), "--hidden-size",
            str(args.hidden), "--num-attention-heads", "8", "--seq-length", "64", "--max-position-embeddings", "64",
            "--micro-batch-size", "1", "--train-iters", "1", "--eval-iters", "0",
            "--log-interval", "100"] + (["--bf16"] if args.bf16 else [])
    rows = []
    with DistributedWorld(args.dp, timeout_s=900) as world:
        for strategy in STRATEGIES:
            per_rank = world.run(held_bytes, argv + ["--data-parallel-sharding-strategy", strategy])
            worst = {key: max(rank[key] for rank in per_rank) for key in per_rank[0]}
            rows.append({"strategy": strategy, **worst, "total": sum(worst.values())})
    for row in rows:
        row["vs_no_shard"] = row["total"] / rows[0]["total"]
    print(json.dumps(rows, indent=2) if args.json else markdown(rows, args))
    return 0


def markdown(rows: list[dict], args) -> str:
    """The rows as docs/fsdp.md's table (MiB per rank)."""
    title = (f"dp{args.dp}, GPT {args.layers} layers x hidden {args.hidden}, {'bf16' if args.bf16 else 'fp32'}, "
             f"AdamW; MiB per rank (1/dp = {1 / args.dp:.3f})")
    lines = [title, "", "| strategy | weights | gradients | optimizer | total | x no_shard |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join([row["strategy"], *(f"{row[key] / 2**20:.2f}" for key in COLUMNS),
                                 f"{row['vs_no_shard']:.3f}"]) + " |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
