"""mega's GPT and LLaMA against Hugging Face ``transformers`` on one device: forward + backward.

Both models hold the same weights (mapped by the families' ``hf_mapping``) and do the same work
per step: full-vocabulary logits, mean cross-entropy, backward. Columns: median step time over
the timed steps, tokens per second, and mega's speed relative to Hugging Face's.

    python benchmarks/bench_models.py                  # both families, fp32 and bf16 autocast
    python benchmarks/bench_models.py --family llama --dtype fp32 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

from mega.core.build import build_stage  # noqa: E402
from mega.models import hf_mapping  # noqa: E402
from mega.models.gpt.family import FAMILY as GPT_FAMILY  # noqa: E402
from mega.models.gpt.hf_gpt2 import GPT2, gpt2_config  # noqa: E402
from mega.models.llama.family import FAMILY as LLAMA_FAMILY  # noqa: E402
from mega.models.llama.hf_llama import LLAMA, llama_config  # noqa: E402


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and batch shape flags that hf_configs reads (shared with bench_training.py)."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)


def hf_configs(args) -> dict:
    h, layers, heads, vocab, seq = args.hidden, args.layers, args.heads, args.vocab, args.seq
    return {
        "gpt": transformers.GPT2Config(vocab_size=vocab, n_embd=h, n_layer=layers, n_head=heads, n_positions=seq,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "llama": transformers.LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=int(8 * h / 3) // 64 * 64,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=max(1, heads // 2), max_position_embeddings=seq),
    }


def models(family: str, hf_config):
    torch.manual_seed(0)
    if family == "gpt":
        hf_model = transformers.GPT2LMHeadModel(hf_config)
        config, mapping = gpt2_config(hf_config.to_dict()), GPT2
    else:
        hf_model = transformers.LlamaForCausalLM(hf_config)
        config, mapping = llama_config(hf_config.to_dict()), LLAMA
    mega_model = build_stage(mapping_family(config), config, init=False)
    mega_model.load_state_dict(hf_mapping.hf_to_mega(mapping, hf_model.state_dict(), config))
    return hf_model.train(), mega_model.train()


def hf_loss(model, ids, labels):
    logits = model(ids).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def mega_loss(model, ids, labels):
    return model.loss(model(ids), labels).mean()


def step_time(model, loss_fn, ids, labels, dtype: str) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
        loss = loss_fn(model, ids, labels)
    loss.backward()
    return time.perf_counter() - start


def median_step_times(hf_model, mega_model, ids, labels, dtype: str, warmup: int, steps: int):
    """Steps alternate between the two models, so both see the same machine load."""
    hf_times, mega_times = [], []
    for step in range(warmup + steps):
        hf_s = step_time(hf_model, hf_loss, ids, labels, dtype)
        mega_s = step_time(mega_model, mega_loss, ids, labels, dtype)
        if step >= warmup:
            hf_times.append(hf_s)
            mega_times.append(mega_s)
    return statistics.median(hf_times), statistics.median(mega_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["gpt", "llama", "both"], default="both")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both")
    add_shape_arguments(parser)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    families = ["gpt", "llama"] if args.family == "both" else [args.family]
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    tokens = args.batch * args.seq
    rows = []
    for family in families:
        hf_model, mega_model = models(family, hf_configs(args)[family])
        for dtype in dtypes:
            hf_s, mega_s = median_step_times(hf_model, mega_model, ids, labels, dtype, args.warmup, args.steps)
            rows.append({"family": family, "dtype": dtype, "hf_step_s": hf_s, "mega_step_s": mega_s,
                         "hf_tokens_per_s": tokens / hf_s, "mega_tokens_per_s": tokens / mega_s,
                         "mega_speedup": hf_s / mega_s})
    if args.json:
        print(json.dumps({"args": vars(args), "threads": torch.get_num_threads(), "rows": rows}, indent=2))
        return
    print(f"layers {args.layers}, hidden {args.hidden}, heads {args.heads}, vocab {args.vocab}, seq {args.seq}, "
          f"batch {args.batch}, {torch.get_num_threads()} threads; forward+backward, median of {args.steps} steps")
    print(f"{'family':<7}{'dtype':<6}{'HF s/step':>11}{'mega s/step':>13}{'HF tok/s':>11}{'mega tok/s':>12}{'mega/HF':>9}")
    for r in rows:
        print(f"{r['family']:<7}{r['dtype']:<6}{r['hf_step_s']:>11.4f}{r['mega_step_s']:>13.4f}"
              f"{r['hf_tokens_per_s']:>11.0f}{r['mega_tokens_per_s']:>12.0f}{r['mega_speedup']:>8.2f}x")


if __name__ == "__main__":
    main()


def mapping_family(config):
    return GPT_FAMILY if config.position_embedding_type == "learned_absolute" else LLAMA_FAMILY
