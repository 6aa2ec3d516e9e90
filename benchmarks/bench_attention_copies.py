"""Copies, ``cat`` and dtype conversions of LLaMA's forward and backward, counted op by op on any
device (issue 31, item 4: attention without contiguity copies).

Builds layers of the LLaMA 1.2B shape (h 2048, ffn 8192, 32/8 heads; ``--num-layers``, 2 by
default, and a small vocabulary: neither changes what a layer does) in bf16 with the torch
kernels, runs one micro-batch forward and backward, and counts with
:mod:`mega.testing.copy_counts`: per layer inside the attention, and in the whole model. It
also names the SDPA kernel torch chose, which decides whether the attention output costs a copy
(a kernel that keeps the query's sequence-major layout, CPU's or cuDNN's: none; flash or
memory-efficient on CUDA: one). The speed this buys is measured by ``bench_gpu_mfu.py``
(docs/benchmarks.md).

    python benchmarks/bench_attention_copies.py --device cuda --json
    python benchmarks/bench_attention_copies.py --device cpu     # sequence 256, micro-batch 1
"""

from __future__ import annotations

import argparse
import json

import torch

from mega.core.build import build_stage
from mega.models.llama import family as llama
from mega.testing.copy_counts import count_copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seq-length", type=int, help="default 2048 on CUDA, 256 elsewhere")
    parser.add_argument("--micro-batch-size", type=int, help="default 4 on CUDA, 1 elsewhere")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")  # a CPU counts the same ops on a smaller step
    args.seq_length = args.seq_length or (2048 if cuda else 256)
    args.micro_batch_size = args.micro_batch_size or (4 if cuda else 1)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = llama.llama_config(args.num_layers, 2048, 8192, 32, 8, llama3=True, vocab_size=1024,
                                seq_length=args.seq_length)
    model = build_stage(llama.FAMILY, config, dtype=dtype, device=args.device)
    attentions = [layer.self_attention for layer in model.decoder.layers.values()]
    tokens = torch.randint(0, 1024, (args.micro_batch_size, args.seq_length), device=args.device)
    counts = count_copies(lambda: model(tokens).float().square().mean().backward(), attentions)
    result = {
        "device": torch.cuda.get_device_name(args.device) if cuda else args.device,
        "dtype": args.dtype,
        "sdpa": sorted(name for name in counts.ops if "scaled_dot_product" in name),
        "attention_per_layer": {f"{kind} {phase}": n / args.num_layers for (kind, phase), n in counts.scoped.items()},
        "model": {f"{kind} {phase}": n for (kind, phase), n in counts.counts.items()},
        "layers": args.num_layers,
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
