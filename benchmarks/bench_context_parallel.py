"""Context parallelism: activation memory and bytes sent per rank, at cp = 1, 2, 4.

A LLaMA-shaped stage (RoPE, GQA, SwiGLU; fp32, by default 2 layers, hidden 256, 8 heads, 2
key/value groups) runs one micro-batch of one long sequence forward and backward on cp gloo
ranks, each holding its 2 load-balanced chunks. Per rank it reports

* the bytes autograd keeps for the backward (every saved storage counted once,
  :func:`mega.testing.saved_activations.saved_activation_bytes`), which should fall as ~1/cp;
* the bytes each rank sends over the context group per layer (forward and backward), counted by
  :class:`mega.core.parallel.CommCounter` (ring sends as they are; a collective as the ring
  algorithm moves it, ``(cp - 1) / cp`` of its buffer), against the formula of each comm type,
  with ``B_kv = 2 b h_kv (s/cp) d`` and ``B_q = b h (s/cp) d`` elements:
  p2p ``(3cp - 2) B_kv`` (cp - 1 key/value blocks forward, as many again and cp gradient blocks
  backward), all_gather ``3 (cp - 1) B_kv`` (gathered forward, gathered again and reduce-scattered
  backward), a2a ``2 (cp - 1)/cp (2 B_q + B_kv')`` (queries, keys, values and output each way;
  ``B_kv'`` has the key/value heads repeated up to a multiple of cp).

    python benchmarks/bench_context_parallel.py [--seq 4096] [--cp 1 2 4] [--comm p2p all_gather a2a] [--json]
"""

from __future__ import annotations

import argparse
import json


def measure(cp: int, comm: str, seq: int, hidden: int, heads: int, groups_kv: int, layers: int) -> dict:
    import torch

    from mega.core.build import build_stage
    from mega.core.kernels import Kernels
    from mega.core.model_family import LossContext
    from mega.core.parallel import CommCounter, ParallelConfig, ParallelGroups
    from mega.core.parallel.context_parallel import split_batch
    from mega.core.plugins import get_plugins
    from mega.testing.saved_activations import saved_activation_bytes

    family = get_plugins().models.get("llama")
    config = family.preset("tiny", num_layers=layers, hidden_size=hidden, ffn_hidden_size=2 * hidden,
                           num_attention_heads=heads, num_query_groups=groups_kv, kv_channels=hidden // heads,
                           seq_length=seq, max_position_embeddings=seq,
                           vocab_size=1024)
    parallel = ParallelConfig(cp=cp, cp_comm_type=comm)
    groups = ParallelGroups(parallel)
    model = build_stage(family, config, groups=groups, seed=1)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (1, seq + 1), generator=generator)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, seq)}
    batch = split_batch(batch, groups.cp, seq)
    context = LossContext(config, groups.tp, Kernels(), groups.cp)
    with CommCounter() as counts:
        saved, loss = saved_activation_bytes(lambda: family.loss(model(batch), batch, context)[0],
                                             exclude=batch.values())
        loss.backward()
    sent = 0.0
    for (kind, group), stats in counts.stats.items():
        if group != "cp":
            continue
        sent += stats.bytes if kind == "send" else stats.bytes * (cp - 1) / cp
    d, b, local = hidden // heads, 1, seq // cp
    block_kv, block_q = 2 * b * groups_kv * local * d * 4, b * heads * local * d * 4
    kv_heads_a2a = groups_kv if groups_kv % cp == 0 else heads
    formula = {"p2p": (3 * cp - 2) * block_kv, "all_gather": 3 * (cp - 1) * block_kv,
               "a2a": 2 * (cp - 1) / cp * (2 * block_q + 2 * b * kv_heads_a2a * local * d * 4)}[comm]
    return {"cp": cp, "comm": comm, "saved_mib": saved / 2**20, "sent_mib_per_layer": sent / layers / 2**20,
            "formula_mib_per_layer": (formula if cp > 1 else 0) / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096, help="sequence length (4096)")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes (1 2 4)")
    parser.add_argument("--comm", nargs="+", default=["p2p", "all_gather", "a2a"], help="comm types")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--query-groups", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from mega.testing import DistributedWorld

    rows = []
    for cp in args.cp:
        for comm in args.comm if cp > 1 else ["p2p"]:
            call = (cp, comm, args.seq, args.hidden, args.heads, args.query_groups, args.layers)
            if cp == 1:
                results = [measure(*call)]
            else:
                with DistributedWorld(cp, timeout_s=1200) as world:
                    results = world.run(measure, *call)
            row = max(results, key=lambda r: r["saved_mib"])  # the busiest rank
            row["sent_mib_per_layer"] = max(r["sent_mib_per_layer"] for r in results)
            rows.append(row)
    base = rows[0]["saved_mib"]
    for row in rows:
        row["saved_vs_cp1"] = row["saved_mib"] / base
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"LLaMA-shaped, fp32: seq {args.seq}, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
          f"{args.query_groups} key/value groups; one micro-batch of one sequence")
    print("| cp | comm | saved activations MiB/rank | x cp1 | sent MiB/rank/layer | formula MiB |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['cp']} | {row['comm'] if row['cp'] > 1 else '-'} | {row['saved_mib']:.1f} | "
              f"{row['saved_vs_cp1']:.3f} | {row['sent_mib_per_layer']:.3f} | {row['formula_mib_per_layer']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
