"""Speculative decoding in the one loop (issue 52 item 1). Runs on CPU, fp32 (pinned: ``--device cpu``).

- Greedy: ``mega generate`` and ``mega serve`` (their whole ``main``) give the tokens they give
  without speculation, for n-gram prompt lookup and a draft model, on one prompt and on a mixed
  batch of 8, on the paged and the static KV cache; the server's ``/metrics`` counts the drafts.
- Sampling keeps the target's distribution: the rejection rule alone on a 6-token vocabulary
  (point-mass and draft-model drafts), and the whole loop's first two sampled tokens against the
  target model's own probabilities (chi-square, p-values stated in the tests).
- One verify forward per speculative step for rows at any cached lengths, on the paged and the
  static cache (its fixed-shape window step, compiled with torch.compile as ``--compile`` does).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from in_process_server import serving  # noqa: E402
from tiny_models import POSITIONS, VOCAB, hf_tiny, mega_from_hf  # noqa: E402

from mega.inference.engine import GenerationEngine, GenerationRequest  # noqa: E402
from mega.inference.engine.continuous import ContinuousBatchingWorker  # noqa: E402
from mega.inference.engine.sampling import SamplingParams  # noqa: E402
from mega.inference.engine.speculative import (  # noqa: E402
    DraftModelProposer,
    NgramProposer,
    Speculator,
    accept_sampled,
)
from mega.inference.engine.stopping import StopRules  # noqa: E402

TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)]
# Code-edit style prompts repeat themselves (prompt lookup finds drafts), others do not.
BATCH = ["5 17 42 8 5 17 42 8 5 17", "7 9", "1 2 3 4 5 6 7 8 9 10 11", "3 3 3 3", "9 8 7 9 8 7",
         "1", "100 101 102 100 101", "4 5 6 7 4 5"]
NEW_TOKENS = 16


def chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square test of ``counts`` against ``expected_probs`` (cells
    with no expected probability must be empty)."""
    total = counts.sum()
    kept = expected_probs > 0
    assert counts[~kept].sum() == 0, "a token the target never draws was drawn"
    expected = expected_probs[kept].double() * total
    statistic = ((counts[kept].double() - expected) ** 2 / expected).sum()
    degrees = int(kept.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.double), statistic / 2))


def saved(tmp_path_factory, model, name: str):
    """``model`` saved as a Hugging Face directory."""
    directory = tmp_path_factory.mktemp(name)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return saved(tmp_path_factory, hf_tiny("llama"), "llama")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """The target's weights, each perturbed: a draft that agrees with it often, not always."""
    model = hf_tiny("llama")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return saved(tmp_path_factory, model, "draft")


def generate(llama_dir, prompts: list[str], flags: list[str], capsys) -> list[list[int]]:
    from mega.inference.cli.generate import main as generate_main

    argv = ["--load", str(llama_dir), "--device", "cpu", *TOKENIZER, "--max-tokens", str(NEW_TOKENS), "--json",
            "--greedy", *flags, *(arg for prompt in prompts for arg in ("--prompt", prompt))]
    assert generate_main(argv) == 0
    return [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_tokens_equal_without_speculation(llama_dir, draft_dir, method, capsys):
    """Batch 1 and a mixed batch of 8, paged and static cache, through ``mega generate``; the
    batch of 8 through ``mega serve`` (``PUT /api``), whose ``/metrics`` show the drafts."""
    flags = ["--num-speculative-tokens", "4", "--speculative-method", method]
    if method == "draft_model":
        flags += ["--speculative-model", str(draft_dir)]
    plain = generate(llama_dir, BATCH, [], capsys)
    for cache in ([], ["--static-kv-cache"]):
        assert generate(llama_dir, BATCH, flags + cache, capsys) == plain, cache
        assert generate(llama_dir, BATCH[:1], flags + cache, capsys) == plain[:1], cache
    body = {"prompts": BATCH, "tokens_to_generate": NEW_TOKENS, "top_k": 1}
    with serving(["--load", str(llama_dir), "--device", "cpu", *TOKENIZER, *flags]) as send:
        answer, metrics = send("PUT", "/api", body), send("GET", "/metrics")
    assert answer.status_code == 200, answer.text
    for prompt, tokens, mine in zip(BATCH, answer.json()["tokens"], plain, strict=True):
        assert tokens[len(prompt.split()):] == mine, prompt
    values = dict(line.rsplit(" ", 1) for line in metrics.text.splitlines() if line.startswith("mega_spec_decode"))
    assert float(values["mega_spec_decode_draft_tokens_total"]) > 0
    assert 0 < float(values["mega_spec_decode_acceptance_rate"]) <= 1
    assert float(values["mega_spec_decode_tokens_per_step"]) > 1


def test_speculation_flags_are_checked(llama_dir, capsys):
    from mega.inference.cli.generate import main as generate_main

    base = ["--load", str(llama_dir), "--device", "cpu", *TOKENIZER, "--prompt", "1 2"]
    with pytest.raises(SystemExit, match="needs --speculative-model"):
        generate_main([*base, "--num-speculative-tokens", "2", "--speculative-method", "draft_model"])
    with pytest.raises(SystemExit, match="need --num-speculative-tokens"):
        generate_main([*base, "--speculative-method", "ngram"])
    with pytest.raises(SystemExit, match="need --num-speculative-tokens"):
        generate_main([*base, "--speculative-disable-by-batch-size", "4"])
    with pytest.raises(SystemExit, match="--speculative-disable-by-batch-size must be at least 2, got 1"):
        generate_main([*base, "--num-speculative-tokens", "2", "--speculative-disable-by-batch-size", "1"])


@pytest.mark.parametrize("draft_kind", ["point_mass", "draft_model"])
def test_rejection_sampling_keeps_the_target_distribution(draft_kind):
    """20,000 draws of the first kept token on a 6-token vocabulary, whatever the draft: the
    chi-square test against the target's ``p`` gives p > 0.001 (seeded; measured p = 0.16 for
    point masses and 0.49 for a draft distribution; always accepting the draft gives p = 0)."""
    generator = torch.Generator().manual_seed(7)
    p = torch.tensor([[0.35, 0.25, 0.2, 0.1, 0.1, 0.0], [0.1, 0.2, 0.3, 0.2, 0.1, 0.1]])
    q = torch.tensor([[0.1, 0.5, 0.1, 0.1, 0.1, 0.1]])
    counts = torch.zeros(6)
    for _ in range(20_000):
        if draft_kind == "point_mass":
            draft = [1]
            tokens = accept_sampled(draft, p, None, generator)
        else:
            draft = [int(torch.multinomial(q[0], 1, generator=generator))]
            tokens = accept_sampled(draft, p, q, generator)
        counts[tokens[0]] += 1
    assert chi_square_p(counts, p[0]) > 0.001


@pytest.fixture(scope="module")
def engine():
    model, config = mega_from_hf(hf_tiny("llama"), "llama")
    return GenerationEngine(model, vocab_size=config.vocab_size, max_positions=POSITIONS)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_tokens_follow_the_target(engine, method):
    """1,600 sampled continuations (temperature 1.5, top-k 3) of two tokens through the loop
    with speculation: the second token comes out of a speculative step. The 9 (first, second)
    pairs are counted against the target's own probabilities: chi-square p > 0.001 (seeded;
    measured p = 0.17 with prompt lookup, 0.78 with a GPT draft model)."""
    sampling = SamplingParams(temperature=1.5, top_k=3)
    prompt = [5, 17, 5, 17, 5]
    while True:  # a prompt holding every token the target may draw first, so prompt lookup finds drafts
        support = _filtered(_last_logits(engine, prompt), sampling).nonzero().squeeze(1).tolist()
        if set(support) <= set(prompt):
            break
        prompt += support
    if method == "ngram":
        proposer = NgramProposer()
    else:
        draft_model, config = mega_from_hf(hf_tiny("gpt2"), "gpt")
        proposer = DraftModelProposer(GenerationEngine(draft_model, vocab_size=config.vocab_size,
                                                       max_positions=POSITIONS), 64, 64 * POSITIONS, 16)
    speculator = Speculator(proposer, 2)
    worker = ContinuousBatchingWorker(engine, max_batch_size=64, speculator=speculator)
    requests = [GenerationRequest(prompt, 2, SamplingParams(sampling.temperature, sampling.top_k, 0.0, seed)) for seed in range(1600)]
    results = worker.run_to_completion(requests)
    assert speculator.metrics.draft_tokens > 0
    assert pair_chi_square_p(results, lambda tokens: _last_logits(engine, tokens), prompt, sampling) > 0.001


def pair_chi_square_p(results, logits_after, prompt: list[int], sampling: SamplingParams) -> float:
    """The chi-square p-value of the (first, second) generated token pairs of ``results`` against
    the target's own probabilities (``logits_after(tokens)``: its logits after ``tokens``, filtered
    as ``sampling`` filters); every pair must lie in the target's support."""
    with torch.inference_mode():  # the target's distribution of each pair
        first = _filtered(logits_after(prompt), sampling)
        support = first.nonzero().squeeze(1).tolist()
        expected, cells = [], {}
        for token in support:
            second = _filtered(logits_after([*prompt, token]), sampling)
            for other in second.nonzero().squeeze(1).tolist():
                cells[(token, other)] = len(cells)
                expected.append(float(first[token] * second[other]))
    counts = torch.zeros(len(cells))
    for result in results:
        pair = tuple(result.generated)
        assert pair in cells, f"{pair} is outside the target's top-{sampling.top_k} support"
        counts[cells[pair]] += 1
    return chi_square_p(counts, torch.tensor(expected))


def _last_logits(engine: GenerationEngine, tokens: list[int]) -> torch.Tensor:
    """The target's fp32 logits after ``tokens``, through a plain run of the loop's engine."""
    result = engine.generate([GenerationRequest(tokens, 1, logprobs=True, top_logprobs=VOCAB)])[0]
    logits = torch.full((VOCAB,), float("-inf"))
    for token, value in result.top_logprobs[-1]:
        logits[token] = value
    return logits


def _filtered(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Temperature then top-k, as the sampler filters (probabilities in vocabulary order)."""
    scaled = logits / sampling.temperature
    kept = scaled.topk(sampling.top_k).indices
    probs = torch.zeros_like(scaled)
    probs[kept] = scaled[kept].softmax(-1)
    return probs


def test_stops_and_log_probabilities_under_speculation(engine):
    """A stop token met among accepted drafts (the model drafting for itself: every draft
    accepted) ends the sequence there, as without speculation; a batch holding a request for log-probabilities decodes one token per step (nothing drafted)
    and gives the same tokens and log-probabilities."""
    plain = engine.generate([GenerationRequest([1, 2, 1, 2], 12)])[0].generated
    stop = StopRules(stop_ids=frozenset({plain[5]}))
    assert plain[5] not in plain[:5]

    def speculating() -> ContinuousBatchingWorker:
        return ContinuousBatchingWorker(engine, max_batch_size=4, speculator=Speculator(NgramProposer(), 3))

    worker = ContinuousBatchingWorker(engine, max_batch_size=4, speculator=Speculator(
        DraftModelProposer(engine, 4, 4 * POSITIONS, 16), 3))
    stopped = worker.run_to_completion([GenerationRequest([1, 2, 1, 2], 12, stop=stop)])[0]
    assert worker.metrics.acceptance_rate == 1.0
    assert (stopped.generated, stopped.finish_reason) == (plain[:6], "stop")
    batch = [GenerationRequest([5, 6, 5, 6, 5], 12, logprobs=True), GenerationRequest([1, 2, 1, 2], 12)]
    worker = speculating()
    results = worker.run_to_completion(batch)
    expected = engine.generate(batch)
    assert worker.metrics.draft_tokens == 0
    assert [r.generated for r in results] == [r.generated for r in expected]
    torch.testing.assert_close(torch.tensor(results[0].logprobs), torch.tensor(expected[0].logprobs))


def test_no_drafts_at_the_batch_size_that_disables_them(engine):
    """``disable_by_batch_size`` 3 (--speculative-disable-by-batch-size): a batch of four decodes
    one token per row until two rows have finished, then drafts for the two left; the tokens are
    those without speculation."""
    class RowCounting(Speculator):
        def step(self, kv, sequences, sampler):
            self.rows.append(len(sequences))
            return super().step(kv, sequences, sampler)

    batch = [GenerationRequest([1, 2, 1, 2], n) for n in (2, 3, 12, 12)]  # repeating prompts: ngram drafts
    speculator = RowCounting(NgramProposer(), 3, disable_by_batch_size=3)
    speculator.rows = []
    results = ContinuousBatchingWorker(engine, max_batch_size=4, speculator=speculator).run_to_completion(batch)
    assert [r.generated for r in results] == [r.generated for r in engine.generate(batch)]
    assert speculator.rows and max(speculator.rows) == 2 and speculator.metrics.draft_tokens > 0


def test_seeded_sampling_under_speculation_ignores_batch_mates(engine):
    """A seeded request's tokens are the same alone and joining a batch already decoding: every
    draw (first token, verification, correction) comes from its own stream."""
    def seeded(seed: int) -> GenerationRequest:
        return GenerationRequest([5, 6, 5, 6, 5], 10, SamplingParams(temperature=1.2, top_k=20, seed=seed))

    def speculating() -> ContinuousBatchingWorker:
        return ContinuousBatchingWorker(engine, max_batch_size=2, speculator=Speculator(NgramProposer(), 3))

    alone = speculating().run_to_completion([seeded(3)])[0].generated
    # The first request takes the only other row first; the second joins while it decodes.
    worker = speculating()
    together = worker.run_to_completion([GenerationRequest([1, 2, 1, 2], 20), seeded(9), seeded(3)])
    assert together[2].generated == alone
    assert together[1].generated != alone  # another seed, other tokens
    assert worker.metrics.draft_tokens > 0


class CountingSpeculator(Speculator):
    """A speculator that counts the target model's forwards in each of its steps (hooked on the
    model, so a compiled or windowed step counts as the eager one), and the distinct cached
    lengths of the rows it verified."""

    def __init__(self, engine, proposer, num_tokens: int):
        super().__init__(proposer, num_tokens)
        self.forwards: list[int] = []
        self.lengths: list[int] = []  # distinct cached lengths of each step's rows
        engine.model.register_forward_hook(lambda *_: self._count())
        self._inside = False

    def _count(self) -> None:
        if self._inside:
            self.forwards[-1] += 1

    def step(self, kv, sequences, sampler):
        self.forwards.append(0)
        self.lengths.append(len({s.cached for s in sequences}))
        self._inside = True
        try:
            return super().step(kv, sequences, sampler)
        finally:
            self._inside = False


@pytest.mark.parametrize("static", [False, True], ids=["paged", "static"])
def test_one_verify_forward_for_rows_of_any_lengths(static):
    """A mixed batch of 8 prompts of 1 to 11 tokens, prompt lookup (K = 3): every speculative step
    runs the target once, its rows at several cached lengths (the static cache's step over its
    window of slots, as a CUDA graph replays it), and the greedy tokens equal decoding without
    speculation."""
    model, config = mega_from_hf(hf_tiny("llama"), "llama")
    engine = GenerationEngine(model, vocab_size=config.vocab_size, max_positions=POSITIONS)
    requests = [GenerationRequest([int(t) for t in prompt.split()], NEW_TOKENS, SamplingParams(top_k=1))
                for prompt in BATCH]
    plain = [r.generated for r in engine.generate(requests)]
    speculator = CountingSpeculator(engine, NgramProposer(), 3)
    worker = ContinuousBatchingWorker(engine, max_batch_size=8, static_cache=static, speculator=speculator)
    assert [r.generated for r in worker.run_to_completion(requests)] == plain
    assert speculator.metrics.accepted_tokens > 0
    assert max(speculator.lengths) >= 4  # rows at many lengths verified together
    assert set(speculator.forwards) == {1}


def test_a_compiled_verify_step_on_the_static_cache(engine):
    """``mega serve --compile --static-kv-cache --num-speculative-tokens 3``: the verify step (as
    the decode step) goes through torch.compile (its ``eager`` backend: the traced graph runs as
    traced), compiled when the worker is made (one slot: the decode and the verify step), never
    while requests run, even when fewer drafts than K fit (a padded K+1 step); greedy tokens equal
    decoding without speculation."""
    compiled = []

    def counting_backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    request = GenerationRequest([5, 17, 42, 8, 5, 17, 42], 10, SamplingParams(top_k=1))
    plain = engine.generate([request])[0].generated
    torch._dynamo.reset()
    speculator = Speculator(NgramProposer(), 3)
    worker = ContinuousBatchingWorker(engine, max_batch_size=1, static_cache=True, compile_backend=counting_backend,
                                      speculator=speculator)
    assert len(compiled) == 2
    kv, fed, steps = worker.kv, [], []  # the drafts' widths; the steps' shapes (what a CUDA graph is captured for)
    verify, run = kv.verify, kv.graphs._run
    kv.verify = lambda decoding, tokens, greedy: fed.append(tokens.shape[1]) or verify(decoding, tokens, greedy)
    kv.graphs._run = lambda tokens, *args: steps.append(tuple(tokens.shape)) or run(tokens, *args)
    assert worker.run_to_completion([request])[0].generated == plain
    assert len(compiled) == 2
    assert min(fed) < 4 and set(steps) == {(1, 4)}  # fewer drafts near the token limit, the K+1 step still
    assert speculator.metrics.accepted_tokens > 0
