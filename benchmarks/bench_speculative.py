"""Speculative decoding in the one loop: tokens per second with and without it, and the drafts'
acceptance.

A random-weight LLaMA (``--layers``, ``--hidden``, ...; by default 12 layers of 512 over an
8,000-token vocabulary, where the layers and not the output head take most of a token's work, so
a 1-layer draft costs a fraction of the model) generates greedily ``--new-tokens`` tokens
after a code-edit style prompt: a random snippet of ``--snippet`` tokens, then the snippet again
with its first half (the "edited" copy the model continues). Three runs of the same requests on
the paged KV cache (``--static-kv-cache``: the static one): no speculation; prompt lookup (``--speculative-method ngram``); a draft model
(``--speculative-method draft_model``), here the target's first ``--draft-layers`` layers with its
embeddings and head (a layer-skip draft: same weights, no training needed, agrees with the target
where the later layers change little). Random weights give no such agreement (a 1-layer cut of a
random 6-layer model accepted 0 of its drafts), so the target's later layers have their output
projections scaled by ``--late-layer-scale`` (default 0.1): they refine the first layers' answer
rather than overturn it, as a trained model's later layers mostly do. With ``1.0`` the target is
plain random and the draft model's figures show the cost of drafts that are never accepted. The tokens of the three runs are checked equal; columns:
median seconds, tokens per second, speed-up over no speculation, acceptance rate (accepted over
drafted tokens) and tokens per sequence per step.

The MTP row (``--speculative-method mtp``) needs a model with multi-token-prediction layers whose
drafts mean something: a DeepSeek-V3 (``--mtp-target-layers`` layers of ``--mtp-hidden``, 8
experts, one MTP layer, a ``--vocab`` vocabulary) trained ``--mtp-train-steps`` Adam steps on a
stream repeating a random ``--mtp-cycle``-token cycle, so its MTP layer predicts the stream's
continuation; the prompts are pieces of the stream (``--snippet`` tokens and less). Plain decoding
against MTP drafts, tokens checked equal. ``--mtp-noise S`` adds noise of std S to the MTP layer's
weights after training (a weaker head: fewer drafts accepted). ``--rows mtp`` runs it alone,
``--rows llama`` the others alone.

    python benchmarks/bench_speculative.py
    python benchmarks/bench_speculative.py --batches 1 8 --k 4 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from bench_generate import hf_model, mega_engine, time_call  # noqa: E402

from mega.core.build import build_stage  # noqa: E402
from mega.core.model_family import LossContext  # noqa: E402
from mega.inference.engine import GenerationEngine, GenerationRequest  # noqa: E402
from mega.inference.engine.continuous import BLOCK_SIZE, ContinuousBatchingWorker  # noqa: E402
from mega.inference.engine.mtp_proposer import MTPProposer  # noqa: E402
from mega.inference.engine.speculative import DraftModelProposer, NgramProposer, Speculator  # noqa: E402
from mega.models.deepseek_v3 import family as deepseek  # noqa: E402


def layer_skip_draft(target_hf, layers: int):
    """The target's Hugging Face model cut to its first ``layers`` layers (same embeddings, norm
    and head)."""
    draft = type(target_hf)(type(target_hf.config)(**{**target_hf.config.to_dict(), "num_hidden_layers": layers}))
    state = {name: tensor for name, tensor in target_hf.state_dict().items()
             if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
    draft.load_state_dict(state)
    return draft.eval()


def scale_late_layers(model, first: int, scale: float) -> None:
    """Scale the attention and MLP output projections of the layers after the first ``first``."""
    with torch.no_grad():
        for layer in model.model.layers[first:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)


def code_edit_prompts(batch: int, args) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    prompts = []
    for _ in range(batch):
        snippet = torch.randint(0, args.vocab, (args.snippet,), generator=generator).tolist()
        prompts.append(snippet + snippet[: args.snippet // 2])
    return prompts


def bench(batch: int, engine, draft_engine, args) -> dict:
    tokens = batch * engine.max_positions

    def worker(speculator=None):
        return ContinuousBatchingWorker(engine, max_batch_size=batch, max_num_tokens=tokens, speculator=speculator,
                                        static_cache=args.static_kv_cache)

    return compare(batch, code_edit_prompts(batch, args), args, {
        "plain": worker(),
        "ngram": worker(Speculator(NgramProposer(args.prompt_lookup_max, 1), args.k,
                                   disable_by_batch_size=args.disable_by_batch_size)),
        "draft_model": worker(Speculator(DraftModelProposer(draft_engine, batch, tokens, BLOCK_SIZE), args.k,
                                         disable_by_batch_size=args.disable_by_batch_size)),
    })


def trained_mtp_engine(args) -> tuple[GenerationEngine, list[int]]:
    """A DeepSeek-V3 with one MTP layer trained on a stream repeating a random cycle; the stream."""
    config = dataclasses.replace(deepseek.PRESETS["tiny"], num_layers=args.mtp_target_layers,
                                 moe_layer_freq=f"[0]*1+[1]*{args.mtp_target_layers - 1}", hidden_size=args.mtp_hidden,
                                 vocab_size=args.vocab, seq_length=64, mtp_num_layers=1, mtp_loss_scaling_factor=1.0,
                                 max_position_embeddings=args.prompt + args.new_tokens)
    generator = torch.Generator().manual_seed(0)
    cycle = torch.randperm(args.vocab, generator=generator)[: args.mtp_cycle]
    stream = cycle.repeat(-(-(args.prompt + args.new_tokens + 2 * args.mtp_cycle) // args.mtp_cycle))
    model = build_stage(deepseek.FAMILY, config, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(args.mtp_train_steps):
        starts = torch.randint(0, args.mtp_cycle, (8,), generator=generator)
        tokens = torch.stack([stream[start: start + 65] for start in starts])
        outputs = model({"tokens": tokens[:, :-1]})
        loss, metrics = deepseek.FAMILY.loss(outputs, {"labels": tokens[:, 1:], "loss_mask": torch.ones(8, 64)},
                                      LossContext(config=config, kernels=model.kernels))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"# DeepSeek-V3 for the MTP row: lm loss {float(metrics['lm loss']):.3f}, "
          f"mtp_1 loss {float(metrics['mtp_1 loss']):.3f} after {args.mtp_train_steps} steps", file=sys.stderr)
    with torch.no_grad():
        for parameter in model.mtp.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * args.mtp_noise)
    model = model.eval().to(device=args.device, dtype=getattr(torch, args.dtype))
    return GenerationEngine(model, vocab_size=args.vocab, max_positions=config.max_position_embeddings), stream.tolist()


def bench_mtp(batch: int, engine, stream: list[int], args) -> dict:
    tokens = batch * engine.max_positions
    generator = torch.Generator().manual_seed(batch)
    prompts = []
    for _ in range(batch):  # pieces of the stream, of several lengths
        start, length = (int(torch.randint(1, high, (), generator=generator)) for high in (args.mtp_cycle, args.snippet))
        prompts.append(stream[start: start + length])

    def worker(speculator=None):
        return ContinuousBatchingWorker(engine, max_batch_size=batch, max_num_tokens=tokens, speculator=speculator)

    return compare(batch, prompts, args, {
        "plain": worker(), "mtp": worker(Speculator(MTPProposer(engine, batch, tokens, BLOCK_SIZE), args.k,
                                           disable_by_batch_size=args.disable_by_batch_size))})


def compare(batch: int, prompts: list[list[int]], args, workers: dict) -> dict:
    """Each worker's median time over the same requests (``plain``: no speculation), its tokens
    per second, and for the others the speed-up and their drafts' figures."""
    times: dict[str, list[float]] = {name: [] for name in workers}
    outputs = {}
    for repeat in range(args.warmup + args.repeats):  # alternate: all see the same machine load
        for name, run in workers.items():
            requests = [GenerationRequest(p, args.new_tokens) for p in prompts]
            seconds, results = time_call(lambda run=run, requests=requests: run.run_to_completion(requests))
            outputs[name] = [r.generated for r in results]
            if repeat >= args.warmup:
                times[name].append(seconds)
    row = {"batch": batch, "k": args.k, "same_tokens": all(out == outputs["plain"] for out in outputs.values())}
    for name, run in workers.items():
        row[f"{name}_s"] = statistics.median(times[name])
        row[f"{name}_tokens_per_s"] = batch * args.new_tokens / row[f"{name}_s"]
        if name != "plain":
            row[f"{name}_speedup"] = row["plain_s"] / row[f"{name}_s"]
            row[f"{name}_acceptance"] = run.metrics.acceptance_rate
            row[f"{name}_tokens_per_step"] = run.metrics.tokens_per_step
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--snippet", type=int, default=96, help="tokens of the snippet the prompt repeats")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, default=None, metavar="N",
                        help="--speculative-disable-by-batch-size: steps of N or more rows decode without drafts")
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--late-layer-scale", type=float, default=0.1,
                        help="scale of the target's layers after --draft-layers (1.0: plain random weights)")
    parser.add_argument("--rows", nargs="+", choices=("llama", "mtp"), default=["llama", "mtp"],
                        help="llama: no speculation, ngram and draft model on the LLaMA; mtp: the DeepSeek-V3 "
                             "without and with MTP drafts")
    parser.add_argument("--mtp-target-layers", type=int, default=8, help="layers of the MTP row's DeepSeek-V3")
    parser.add_argument("--mtp-hidden", type=int, default=256)
    parser.add_argument("--mtp-cycle", type=int, default=32, help="tokens of the cycle the MTP row's model learns")
    parser.add_argument("--mtp-train-steps", type=int, default=60)
    parser.add_argument("--mtp-noise", type=float, default=0.0, help="std of noise added to the trained MTP layer")
    parser.add_argument("--static-kv-cache", action="store_true",
                        help="the LLaMA rows on the static (slot) KV cache instead of the paged one")
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.prompt = args.snippet + args.snippet // 2  # what bench_generate's model builder sizes positions by
    if "llama" in args.rows:
        llama_rows(args)
    if "mtp" in args.rows:
        mtp_rows(args)


def llama_rows(args) -> None:
    target_hf = hf_model("llama", args)
    scale_late_layers(target_hf, args.draft_layers, args.late_layer_scale)
    engine = mega_engine("llama", target_hf, args)
    draft_engine = mega_engine("llama", layer_skip_draft(target_hf, args.draft_layers), args)
    for batch in args.batches:
        row = bench(batch, engine, draft_engine, args)
        if args.json:
            print(json.dumps(row))
            continue
        print(f"batch {batch}, K={args.k}: plain {row['plain_tokens_per_s']:.1f} tok/s; "
              f"ngram {row['ngram_tokens_per_s']:.1f} tok/s ({row['ngram_speedup']:.2f}x, acceptance "
              f"{row['ngram_acceptance']:.2f}, {row['ngram_tokens_per_step']:.2f} tokens/step); draft model "
              f"{row['draft_model_tokens_per_s']:.1f} tok/s ({row['draft_model_speedup']:.2f}x, acceptance "
              f"{row['draft_model_acceptance']:.2f}, {row['draft_model_tokens_per_step']:.2f} tokens/step); "
              f"same tokens: {row['same_tokens']}")


def mtp_rows(args) -> None:
    engine, stream = trained_mtp_engine(args)
    for batch in args.batches:
        row = bench_mtp(batch, engine, stream, args)
        if args.json:
            print(json.dumps({"model": "deepseek-v3-mtp", **row}))
            continue
        print(f"batch {batch}, K={args.k}, DeepSeek-V3 {args.mtp_target_layers}x{args.mtp_hidden}: plain "
              f"{row['plain_tokens_per_s']:.1f} tok/s; mtp {row['mtp_tokens_per_s']:.1f} tok/s "
              f"({row['mtp_speedup']:.2f}x, acceptance {row['mtp_acceptance']:.2f}, "
              f"{row['mtp_tokens_per_step']:.2f} tokens/step); same tokens: {row['same_tokens']}")


if __name__ == "__main__":
    main()
