"""Optimizer-state bytes of LoRA against full fine-tuning, on LLaMA shapes (bf16 parameters).

Builds each model with mega's LLaMA family, optionally adds rank-R LoRA adapters on every linear
layer (``mega.models.lora.adapters.apply_lora``: the base frozen), wraps it for data parallelism, takes one
AdamW step through mega's mixed-precision optimizer and reports the bytes the optimizer holds (fp32
main copies plus Adam's two moments), counted from its tensors after the step.

    python benchmarks/bench_lora_memory.py [--rank 16] [--sizes tiny 512x8 1024x12] [--json]

A size is a preset (``tiny``) or ``HIDDENxLAYERS`` (LLaMA proportions: heads of 64, SwiGLU).
"""

from __future__ import annotations

import argparse
import json


def llama_config(size: str):
    from mega.core.plugins import get_plugins

    family = get_plugins().models.get("llama")
    if "x" not in size:
        return family, family.preset(size, vocab_size=32000, seq_length=64)
    hidden, layers = (int(part) for part in size.split("x"))
    heads = hidden // 64
    return family, family.preset("tiny", vocab_size=32000, seq_length=64, hidden_size=hidden, num_layers=layers,
                                 num_attention_heads=heads, num_query_groups=heads, kv_channels=64,
                                 ffn_hidden_size=int(8 * hidden / 3) // 64 * 64)


def state_bytes(size: str, rank: int) -> dict:
    import torch

    from mega.core.build import build_stage
    from mega.core.distributed import DDPConfig, DistributedDataParallel
    from mega.core.optim import OptimizerConfig, build_optimizer
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.models.lora.adapters import LoRASettings, apply_lora

    family, config = llama_config(size)
    groups = ParallelGroups(ParallelConfig())
    model = build_stage(family, config, groups=groups, seed=1, dtype=torch.bfloat16)
    if rank:
        apply_lora(model, LoRASettings(rank=rank, alpha=2.0 * rank), seed=1)
    ddp = DistributedDataParallel(model, groups, DDPConfig(grad_reduce_in_fp32=True))
    optimizer = build_optimizer([ddp], groups, OptimizerConfig())
    tokens = torch.randint(0, config.vocab_size, (1, config.seq_length))
    model.loss(ddp(tokens), tokens).mean().backward()
    ddp.finish_grad_sync()
    optimizer.step()
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"size": size, "lora_rank": rank, "parameters": total, "trained": trained,
            "optimizer_bytes": optimizer.state_bytes()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "512x8", "1024x12"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import os

    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    rows = []
    for size in args.sizes:
        full, lora = state_bytes(size, 0), state_bytes(size, args.rank)
        rows.append({"size": size, "parameters": full["parameters"], "lora_trained": lora["trained"],
                     "full_MiB": full["optimizer_bytes"] / 2**20, "lora_MiB": lora["optimizer_bytes"] / 2**20,
                     "ratio": lora["optimizer_bytes"] / full["optimizer_bytes"]})
    dist.destroy_process_group()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"| LLaMA size | parameters | LoRA r={args.rank} trained | optimizer MiB, full | optimizer MiB, LoRA | LoRA / full |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['size']} | {row['parameters'] / 1e6:.2f}M | {row['lora_trained'] / 1e6:.3f}M | "
              f"{row['full_MiB']:.2f} | {row['lora_MiB']:.3f} | {row['ratio']:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
