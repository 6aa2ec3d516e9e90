"""Weight-only quantization (``mega generate|serve --quantization``): per kind, the weight bytes,
greedy decode tokens/s at each batch size and the tokens' agreement with the unquantized model;
with ``--perplexity``, the perplexity of a trained checkpoint on the embedded corpus.

Rows: the model in bfloat16 and in ``--dtype`` (the baseline the ratios divide by), then int8,
fp8 and int4 at ``--dtype``, each made by mega-torchao's ``quantization`` setup pass exactly as
``--quantization`` runs it (mega.inference.quantization). Decoding is the engine's one loop: on
CUDA the static KV cache with CUDA graphs (what ``mega generate`` and ``mega serve`` run there),
on the CPU the paged cache. Agreement: the greedy tokens of each sequence equal to the
``--dtype`` baseline's up to the first that differs, averaged (random weights have small next-token
margins: one near tie changes every later token, so compare kinds with it, not with 1.0).

    python benchmarks/bench_quantization.py                          # CPU: a random LLaMA
    python benchmarks/bench_quantization.py --load ckpt/pydoc-llama --perplexity   # a trained one
    # the GPU row (gpu_suite.py "quantization"): the LLaMA 1.2B shape in bfloat16, batch 1 and 16
    python benchmarks/bench_quantization.py --device cuda --dtype bfloat16 --layers 16 --hidden 2048 \\
        --ffn 8192 --heads 32 --groups 8 --vocab 128256 --batches 1 16 --new-tokens 128 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from mega.core.build import build_stage
from mega.core.parallel import ParallelConfig, ParallelGroups
from mega.core.plugins import get_plugins
from mega.inference.engine import GenerationEngine, GenerationRequest
from mega.inference.engine.continuous import ContinuousBatchingWorker
from mega.inference.eval_tasks import perplexity
from mega.inference.loader import load_model
from mega.inference.quantization import QuantizationRequest, quantization_pass, quantize, weight_bytes
from mega.models.llama.family import llama_config

KINDS = ("int8", "fp8", "int4")


def build(args, dtype: torch.dtype, device: torch.device):
    """(model, config, tokenizer, family) of ``--load`` or a random LLaMA of the shape flags (the
    same weights at every call: initialisation is seeded per parameter name)."""
    plugins = get_plugins()
    if args.load:
        loaded = load_model(args.load, groups=ParallelGroups(ParallelConfig()), device=device, dtype=dtype)
        return loaded.model, loaded.config, loaded.tokenizer, plugins.models.get(loaded.family_name)
    family = plugins.models.get("llama")
    config = llama_config(args.layers, args.hidden, args.ffn, args.heads, args.groups, llama3=True,
                          seq_length=args.prompt + args.new_tokens, vocab_size=args.vocab,
                          init_method_std=args.init_std)
    model = build_stage(family, config, device=device, dtype=dtype, init=True, training=False).eval()
    return model, config, None, family


def time_call(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def decode(engine: GenerationEngine, batch: int, args, device: torch.device) -> tuple[float, list[list[int]]]:
    """Median seconds of greedy decoding ``--new-tokens`` after ``--prompt`` random tokens, and the tokens."""
    cuda = device.type == "cuda"
    worker = ContinuousBatchingWorker(engine, max_batch_size=batch, max_num_tokens=batch * engine.max_positions,
                                      static_cache=cuda, use_cuda_graphs=cuda)
    prompts = torch.randint(0, engine.vocab_size, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
    requests = [GenerationRequest(prompt, args.new_tokens) for prompt in prompts.tolist()]
    times, tokens = [], None
    for repeat in range(args.warmup + args.repeats):
        seconds, results = time_call(lambda: worker.run_to_completion(requests), device)
        tokens = [result.generated for result in results]
        if repeat >= args.warmup:
            times.append(seconds)
    return statistics.median(times), tokens


def leading_agreement(tokens: list[list[int]], baseline: list[list[int]]) -> float:
    """The mean fraction of each sequence's tokens equal to the baseline's before the first that differs."""
    fractions = []
    for mine, theirs in zip(tokens, baseline, strict=True):
        equal = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), len(mine))
        fractions.append(equal / len(mine))
    return sum(fractions) / len(fractions)


def corpus_text(documents: int) -> str:
    """The last ``documents`` topics of the embedded corpus (pydoc topics in name order, as
    mega.data.embedded_corpus writes them; a 95,5,0 split validates on the last 5%)."""
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics)[-documents:])


def measure(args, dtype_name: str, kind: str | None, device: torch.device, baseline: dict | None) -> dict:
    dtype = getattr(torch, dtype_name)
    model, config, tokenizer, family = build(args, dtype, device)
    row = {"dtype": dtype_name, "quantization": kind or "none"}
    if kind is not None:
        request = QuantizationRequest(kind, device, dtype)
        model, _ = quantize(model, quantization_pass(request, get_plugins()), request, family, config,
                                 ParallelGroups(ParallelConfig()))
    row["weight_bytes"] = weight_bytes(model)
    engine = GenerationEngine(model, vocab_size=config.vocab_size,
                              max_positions=getattr(config, "max_position_embeddings", None) or config.seq_length)
    row["batches"], outputs = [], {}
    for batch in args.batches:
        seconds, outputs[batch] = decode(engine, batch, args, device)
        row["batches"].append({"batch": batch, "seconds": seconds, "tokens_per_s": batch * args.new_tokens / seconds})
    row["tokens"] = outputs
    if args.perplexity:
        seq_length = min(args.ppl_seq_length, engine.max_positions)
        with torch.inference_mode():
            row["ppl"] = perplexity(model, tokenizer, corpus_text(args.ppl_documents), seq_length, None, device)["ppl"]
    if baseline is not None:
        row["weight_ratio"] = row["weight_bytes"] / baseline["weight_bytes"]
        for mine, theirs in zip(row["batches"], baseline["batches"], strict=True):
            mine["speedup"] = mine["tokens_per_s"] / theirs["tokens_per_s"]
        row["agreement"] = statistics.mean(leading_agreement(outputs[b], baseline["tokens"][b]) for b in args.batches)
        if args.perplexity:
            row["ppl_ratio"] = row["ppl"] / baseline["ppl"]
    del model, engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def table(rows: list[dict], args) -> str:
    head = ["dtype", "quantization", "weights MiB", "x"] + [f"batch {b} tok/s" for b in args.batches] + \
        [f"batch {b} speedup" for b in args.batches] + ["agreement"] + (["ppl", "ppl x"] if args.perplexity else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["dtype"], row["quantization"], f"{row['weight_bytes'] / 2**20:.1f}",
                 f"{row.get('weight_ratio', float('nan')):.2f}"]
        cells += [f"{b['tokens_per_s']:.1f}" for b in row["batches"]]
        cells += [f"{b.get('speedup', float('nan')):.2f}" for b in row["batches"]]
        cells.append(f"{row['agreement']:.2f}" if "agreement" in row else "-")
        if args.perplexity:
            cells += [f"{row['ppl']:.3f}", f"{row.get('ppl_ratio', float('nan')):.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", help="a mega checkpoint or Hugging Face directory (default: a random LLaMA)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the baseline's dtype and the quantized models' activations (default float32)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4, help="key/value heads")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--init-std", type=float, default=0.05, help="the random model's weights' std")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--perplexity", action="store_true",
                        help="also the perplexity on the embedded corpus (needs --load with a tokenizer)")
    parser.add_argument("--ppl-documents", type=int, default=20, help="the corpus's last N topics (default 20)")
    parser.add_argument("--ppl-seq-length", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.perplexity and not args.load:
        parser.error("--perplexity needs --load: a trained checkpoint with its tokenizer")
    device = torch.device(args.device)
    plan = [("bfloat16", None)] if args.dtype != "bfloat16" else []
    plan += [(args.dtype, None)] + [(args.dtype, kind) for kind in args.kinds]
    rows, baseline = [], None
    for dtype_name, kind in plan:
        row = measure(args, dtype_name, kind, device, baseline)
        if dtype_name == args.dtype and kind is None:
            baseline = row
            row["weight_ratio"] = row["agreement"] = 1.0
            for mine in row["batches"]:
                mine["speedup"] = 1.0
            if args.perplexity:
                row["ppl_ratio"] = 1.0
            for earlier in rows:  # the bfloat16 row, measured first, against the baseline too
                earlier["weight_ratio"] = earlier["weight_bytes"] / row["weight_bytes"]
                for mine, theirs in zip(earlier["batches"], row["batches"], strict=True):
                    mine["speedup"] = mine["tokens_per_s"] / theirs["tokens_per_s"]
                if args.perplexity:
                    earlier["ppl_ratio"] = earlier["ppl"] / row["ppl"]
        rows.append(row)
        print(f"{dtype_name} {kind or 'none'}: done", file=sys.stderr, flush=True)
    for row in rows:
        del row["tokens"]
    header = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "threads": torch.get_num_threads(), "load": args.load,
              "shape": None if args.load else {"layers": args.layers, "hidden": args.hidden, "ffn": args.ffn,
                                               "heads": args.heads, "groups": args.groups, "vocab": args.vocab},
              "prompt": args.prompt, "new_tokens": args.new_tokens}
    if args.json:
        print(json.dumps({**header, "quantization": rows}))
    else:
        print(json.dumps(header))
        print(table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
