"""mega's T5 against Hugging Face ``T5ForConditionalGeneration`` on one CPU: a training step and
greedy generation, same weights (mapped by the t5 family's ``hf_mapping``), same shapes.

Training step: forward (encoder and decoder), full-vocabulary logits, mean cross-entropy,
backward; fp32, dropout off. Generation: greedy, both with their KV caches, a batch of prompts
encoded once, ``--new-tokens`` decoded with no end token (both generate every token); the
generated tokens are checked equal. The two sides alternate call by call; medians after one
warm-up.

    python benchmarks/bench_t5.py                       # T5-base, shapes below
    python benchmarks/bench_t5.py --preset small --repeats 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

from mega.core.build import build_stage  # noqa: E402
from mega.core.checkpoint import load_model_weights  # noqa: E402
from mega.inference.engine import GenerationRequest  # noqa: E402
from mega.inference.engine.encoder_decoder import EncoderDecoderEngine  # noqa: E402
from mega.models.hf_mapping import hf_to_mega  # noqa: E402
from mega.models.t5.family import FAMILY  # noqa: E402
from mega.models.t5.hf_t5 import T5_MAPPING, t5_hf_config  # noqa: E402


class _Tensors(dict):
    def get(self, name):
        return self[name]


def models(preset: str, enc: int, dec: int):
    config = FAMILY.preset(preset, seq_length=enc, decoder_seq_length=dec, hidden_dropout=0.0, attention_dropout=0.0)
    hf_config = transformers.T5Config(**{k: v for k, v in t5_hf_config(config).items() if k != "architectures"})
    torch.manual_seed(0)
    hf_model = transformers.T5ForConditionalGeneration(hf_config)
    if config.untie_embeddings_and_output_weights:  # transformers 5 ties lm_head; v1.1 has its own
        hf_model.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf_model.lm_head.weight))
    hf_model.generation_config.eos_token_id = None
    mega_model = build_stage(FAMILY, config, init=False)
    load_model_weights(_Tensors(hf_to_mega(T5_MAPPING, hf_model.state_dict(), config)), [mega_model])
    return config, hf_model, mega_model


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def train_step_hf(model, batch):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["text_enc"], attention_mask=batch["enc_mask"],
                   decoder_input_ids=batch["text_dec"]).logits
    F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).backward()


def train_step_mega(model, batch, context):
    model.zero_grad(set_to_none=True)
    loss, _ = FAMILY.loss(model(batch), batch, context)
    loss.backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--batch", type=int, default=4, help="training micro-batch")
    parser.add_argument("--encoder-seq", type=int, default=128)
    parser.add_argument("--decoder-seq", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--generate-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_flush_denormal(True)

    from mega.core.kernels import Kernels
    from mega.core.model_family import LossContext

    config, hf_model, mega_model = models(args.preset, args.encoder_seq, args.decoder_seq)
    context = LossContext(config, None, Kernels())
    g = torch.Generator().manual_seed(1)
    vocab, b = config.vocab_size, args.batch
    batch = {"text_enc": torch.randint(2, vocab, (b, args.encoder_seq), generator=g),
             "text_dec": torch.randint(2, vocab, (b, args.decoder_seq), generator=g),
             "labels": torch.randint(2, vocab, (b, args.decoder_seq), generator=g),
             "enc_mask": torch.ones(b, args.encoder_seq), "dec_mask": torch.ones(b, args.decoder_seq),
             "loss_mask": torch.ones(b, args.decoder_seq)}
    hf_model.train(), mega_model.train()
    hf_times, mega_times = [], []
    for repeat in range(args.repeats + 1):
        hf_s, _ = timed(lambda: train_step_hf(hf_model, batch))
        mega_s, _ = timed(lambda: train_step_mega(mega_model, batch, context))
        if repeat:
            hf_times.append(hf_s), mega_times.append(mega_s)
    tokens = b * (args.encoder_seq + args.decoder_seq)
    train = {"hf_s": statistics.median(hf_times), "mega_s": statistics.median(mega_times)}
    train.update(hf_tokens_per_s=tokens / train["hf_s"], mega_tokens_per_s=tokens / train["mega_s"],
                 speedup=train["hf_s"] / train["mega_s"])

    hf_model.eval(), mega_model.eval()
    engine = EncoderDecoderEngine(mega_model, vocab_size=vocab, max_positions=max(args.prompt_length, args.new_tokens))
    rows = []
    for size in args.generate_batches:
        prompts = torch.randint(2, vocab, (size, args.prompt_length), generator=g)
        requests = [GenerationRequest(p.tolist(), args.new_tokens) for p in prompts]
        hf_times, mega_times = [], []
        for repeat in range(args.repeats + 1):
            with torch.inference_mode():
                hf_s, hf_out = timed(partial(hf_model.generate, prompts, max_new_tokens=args.new_tokens,
                                             min_new_tokens=args.new_tokens, do_sample=False))
            mega_s, results = timed(partial(engine.generate, requests))
            if repeat:
                hf_times.append(hf_s), mega_times.append(mega_s)
        same = hf_out[:, 1:].tolist() == [r.generated for r in results]
        hf_s, mega_s = statistics.median(hf_times), statistics.median(mega_times)
        generated = size * args.new_tokens
        rows.append({"batch": size, "hf_s": hf_s, "mega_s": mega_s, "hf_tokens_per_s": generated / hf_s,
                     "mega_tokens_per_s": generated / mega_s, "speedup": hf_s / mega_s, "same_tokens": same})
    if args.json:
        print(json.dumps({"args": vars(args), "threads": torch.get_num_threads(), "train": train,
                          "generate": rows}, indent=2))
        return
    print(f"T5 {args.preset}, fp32, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"training step: batch {b}, encoder {args.encoder_seq}, decoder {args.decoder_seq} tokens")
    print("| HF s | mega s | HF tok/s | mega tok/s | mega / HF |\n|---|---|---|---|---|")
    print(f"| {train['hf_s']:.3f} | {train['mega_s']:.3f} | {train['hf_tokens_per_s']:.0f} | "
          f"{train['mega_tokens_per_s']:.0f} | {train['speedup']:.2f}x |")
    print(f"greedy generation: {args.prompt_length}-token prompts, {args.new_tokens} new tokens")
    print("| batch | HF s | mega s | HF tok/s | mega tok/s | mega / HF | same tokens |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['hf_s']:.3f} | {r['mega_s']:.3f} | {r['hf_tokens_per_s']:.1f} | "
              f"{r['mega_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {'yes' if r['same_tokens'] else 'NO'} |")


if __name__ == "__main__":
    main()
