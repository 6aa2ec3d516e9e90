"""Optimizer-state memory per rank: plain mixed-precision optimizer vs the distributed (ZeRO-1) one.

Runs a small GPT-like model (the tiny LM of mega.testing, scaled up) for one AdamW step on
dp = 1, 2, 4 gloo ranks and reports, per rank, the bytes held by the optimizer: fp32 main
parameters (copies of bf16 parameters; fp32 parameters are their own) plus Adam's two moments.
With the distributed optimizer that falls as 1/dp.

    python benchmarks/bench_distributed_optimizer_memory.py [--dp 1 2 4] [--dtype bf16] [--json]
"""

from __future__ import annotations

import argparse
import json


def optimizer_state(distributed: bool, dtype_name: str, hidden: int, layers: int, vocab: int):
    import torch

    from mega.core.distributed import DDPConfig, DistributedDataParallel
    from mega.core.optim import OptimizerConfig, build_optimizer
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.testing.tiny_lm import TinyConfig, TinyLM, make_batch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    groups = ParallelGroups(ParallelConfig())
    config = TinyConfig(vocab=vocab, hidden=hidden, heads=8, query_groups=8, ffn=4 * hidden, layers=layers, seq=32)
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM(config).to(dtype), groups,
                                    DDPConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=True))
    optimizer = build_optimizer([model], groups, OptimizerConfig(use_distributed_optimizer=distributed))
    tokens, labels = make_batch(config, 2, groups.global_rank)
    model(tokens, labels, groups.tp).backward()
    model.finish_grad_sync()
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    return params, optimizer.state_bytes()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="data-parallel sizes (1 2 4)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="parameter dtype (bf16)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from mega.testing import DistributedWorld

    rows = []
    for dp in args.dp:
        for distributed in (False, True):
            call = (distributed, args.dtype, args.hidden, args.layers, args.vocab)
            if dp == 1:
                results = [optimizer_state(*call)]
            else:
                with DistributedWorld(dp, timeout_s=600) as world:
                    results = world.run(optimizer_state, *call)
            params = results[0][0]
            per_rank = max(state for _, state in results)
            rows.append({"dp": dp, "optimizer": "distributed" if distributed else "plain", "params": params,
                         "state_mib_per_rank": per_rank / 2**20, "bytes_per_param": per_rank / params})
    base = {row["optimizer"]: row["state_mib_per_rank"] for row in rows if row["dp"] == min(args.dp)}
    for row in rows:
        row["vs_smallest_dp"] = row["state_mib_per_rank"] / base[row["optimizer"]]

    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{args.dtype} parameters, {rows[0]['params'] / 1e6:.2f}M of them, AdamW")
    print(f"{'dp':>3} {'optimizer':>12} {'state MiB/rank':>15} {'bytes/param':>12} {'x smallest dp':>14}")
    for row in rows:
        print(f"{row['dp']:>3} {row['optimizer']:>12} {row['state_mib_per_rank']:>15.2f} "
              f"{row['bytes_per_param']:>12.2f} {row['vs_smallest_dp']:>14.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
