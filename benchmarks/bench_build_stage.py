"""Peak memory of building one rank's stage of a large model: only its own shards are allocated.

Builds, in a fresh process each, the stage that global rank ``--rank`` of a tp x pp layout holds
(``build_stage``: meta device -> tensor-parallel plan -> materialise the shards -> initialise them
from per-name seeds), with no process group: the rank's view of the layout is enough to build.
Reports the stage's shard bytes, the process's peak RSS above what importing torch and mega
costs, their ratio (target < 1.3) and the time.

    python benchmarks/bench_build_stage.py [--preset llama3-70b] [--tp 8] [--pp 8] [--dtype bf16] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def build_one(preset: str, tp: int, pp: int, rank: int, dtype_name: str) -> dict:
    import resource
    import time

    import torch

    from mega.core.build import build_stage
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.core.plugins import get_plugins

    family = get_plugins().models.get("llama" if preset.startswith("llama") else "gpt")
    config = family.preset(preset)
    parallel = ParallelConfig(tp=tp, pp=pp)
    groups = ParallelGroups(parallel, world_size=tp * pp, rank=rank)
    stage = family.pipeline_stages(config, pp, 1)[groups.pp.rank]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    module = build_stage(family, config, stage, groups=groups, dtype=dtype, device="cpu")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shard_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    first_layer = next(iter(module.decoder.layers.values()))
    full_layer = sum(p.numel() * p.element_size() for p in first_layer.parameters()) * tp
    return {"preset": preset, "tp": tp, "pp": pp, "rank": rank, "dtype": dtype_name,
            "layers": f"{stage.layers['decoder'].start}-{stage.layers['decoder'].stop - 1}",
            "shard_bytes": shard_bytes, "one_full_layer_bytes": full_layer, "rss_above_imports": peak - before,
            "ratio": (peak - before) / shard_bytes, "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3-70b")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--ranks", type=int, nargs="+", default=None,
                        help="global ranks to build (default: the first and a middle pipeline stage's rank 0)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(build_one(args.preset, args.tp, args.pp, args.child, args.dtype)))
        return 0
    ranks = args.ranks or [0, args.tp * (args.pp // 2)]
    rows = []
    for rank in ranks:  # a fresh process each: peak RSS is per process
        out = subprocess.run([sys.executable, __file__, "--preset", args.preset, "--tp", str(args.tp), "--pp",
                              str(args.pp), "--dtype", args.dtype, "--child", str(rank)],
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    gib = 2**30
    print("| model | layout | rank (layers) | dtype | shard | one full layer | peak RSS above imports | ratio | time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['preset']} | tp{row['tp']} x pp{row['pp']} | {row['rank']} ({row['layers']}) | {row['dtype']} "
              f"| {row['shard_bytes'] / gib:.2f} GiB | {row['one_full_layer_bytes'] / gib:.2f} GiB "
              f"| {row['rss_above_imports'] / gib:.2f} GiB | {row['ratio']:.2f}x | {row['seconds']:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
