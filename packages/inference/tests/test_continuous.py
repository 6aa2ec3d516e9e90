"""Continuous batching: sequences that join a running batch, each with its own paged KV cache
blocks, get exactly what the lock-step engine gives each alone (greedy tokens, log-probabilities,
seeded sampling with penalties); a short request overtakes a long one; blocks come back."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import POSITIONS, hf_tiny, mega_from_hf  # noqa: E402

from mega.inference.engine import GenerationEngine, GenerationError, GenerationRequest  # noqa: E402
from mega.inference.engine.continuous import ContinuousBatchingWorker  # noqa: E402
from mega.inference.engine.sampling import SamplingParams  # noqa: E402
from mega.inference.engine.stopping import StopRules  # noqa: E402
from mega.inference.engine.worker import Job  # noqa: E402

PROMPTS = [[5, 17, 42, 8, 99, 3, 1], [7], [200, 13, 60], list(range(30, 50)), [11, 12]]


def free_blocks(allocator) -> int:
    """The blocks on the allocator's free list (what the tests check came back)."""
    return len(allocator._free)


def engine_for(model, config) -> GenerationEngine:
    return GenerationEngine(model, vocab_size=config.vocab_size, max_positions=POSITIONS)


@pytest.fixture(scope="module")
def llama():
    """(mega model, config): the scheduling tests need one family only."""
    return mega_from_hf(hf_tiny("llama"), "llama")


def requests() -> list[GenerationRequest]:
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=3, frequency_penalty=0.5, logit_bias=((4, 2.0),))
    return [
        GenerationRequest(PROMPTS[0], 12, logprobs=True, top_logprobs=2),
        GenerationRequest(PROMPTS[1], 20, sampling=sampled),
        GenerationRequest(PROMPTS[2], 0, logprobs=True),
        GenerationRequest(PROMPTS[3], 9, stop=StopRules(stop_ids=frozenset({1, 2, 3}))),
        GenerationRequest(PROMPTS[4], 30, sampling=SamplingParams(top_k=5, seed=11)),
    ]


async def run_staggered(worker: ContinuousBatchingWorker, batch: list[GenerationRequest]):
    """Each request submitted once the one before has streamed a token: they join a running batch."""
    loop = asyncio.get_running_loop()
    jobs = []
    for request in batch:
        job = Job([request], loop, stream=True)
        worker.submit(job)
        jobs.append(job)
        if request.max_new_tokens:
            while (await job.events.get())[0] != "token":
                pass
    return [(await job.done)[0] for job in jobs]


def staggered_on(worker: ContinuousBatchingWorker, batch: list[GenerationRequest]):
    """:func:`run_staggered` on ``worker``, started for it and stopped after."""
    worker.start()
    try:
        return asyncio.run(run_staggered(worker, batch))
    finally:
        worker.stop()


@pytest.mark.parametrize("static", [False, True], ids=["paged", "static"])
def test_joining_sequences_get_what_each_gets_alone(tiny_pair, static):
    """Paged, or the static cache (a slot per sequence, decode steps over a bucket of slots as
    CUDA graphs would replay them; run eagerly here): three slots serve the five requests."""
    _, model, config = tiny_pair
    engine = engine_for(model, config)
    alone = [engine.generate([request])[0] for request in requests()]
    worker = ContinuousBatchingWorker(engine, max_batch_size=3, max_num_tokens=3 * POSITIONS if static else 96,
                                      block_size=8, static_cache=static)
    assert static == (worker._decode_steps is not None) and (not static or not worker._decode_steps.use_cuda_graphs)
    together = staggered_on(worker, requests())
    for expected, got in zip(alone, together, strict=True):
        assert got.tokens == expected.tokens and got.finish_reason == expected.finish_reason
        if expected.logprobs is not None:
            assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=1e-5)
        if expected.top_logprobs is not None:
            assert [[t for t, _ in top] for top in got.top_logprobs] == \
                   [[t for t, _ in top] for top in expected.top_logprobs]
    assert free_blocks(worker.allocator) == worker.allocator.num_blocks  # every block came back
    if static:  # decode steps ran over windows of 1 and 2 slots, and of all three (the bucket of 4, capped)
        assert sorted(worker.cache._windows) == [(1, 1), (2, 1), (3, 1)]
    # No autograd: a graph chained through the pools would keep every step's activations alive.
    assert not any(layer.keys.requires_grad for layer in worker.cache._layers.values())


def test_greedy_requests_on_the_static_cache_choose_in_the_step(tiny_pair, monkeypatch):
    """CPU. Greedy requests joining a running batch on the static cache: once every row and every
    sequence about to join is greedy, the decode step chooses the tokens itself (the captured
    graph's argmax on CUDA) and the rows just prefilled take their argmax; the tokens and endings
    are what each gets alone."""
    from mega.inference.engine.slot_kv_cache import DecodeGraphs

    _, model, config = tiny_pair
    engine = engine_for(model, config)
    batch = [GenerationRequest(PROMPTS[0], 12), GenerationRequest(PROMPTS[3], 9, stop=StopRules(stop_ids=frozenset({1, 2, 3}))),
             GenerationRequest(PROMPTS[1], 15), GenerationRequest(PROMPTS[4], 6)]
    alone = [engine.generate([request])[0] for request in batch]
    greedy_steps = []
    original = DecodeGraphs.greedy
    monkeypatch.setattr(DecodeGraphs, "greedy", lambda self, *a: greedy_steps.append(1) or original(self, *a))
    worker = ContinuousBatchingWorker(engine, max_batch_size=3, max_num_tokens=3 * POSITIONS, static_cache=True)
    together = staggered_on(worker, batch)
    assert [(r.tokens, r.finish_reason) for r in together] == [(r.tokens, r.finish_reason) for r in alone]
    assert len(greedy_steps) >= 10


@pytest.mark.parametrize("tiny_pair", [("llama", "llama")], indirect=True)
def test_a_compiled_decode_step_on_the_static_cache_gets_what_each_gets_alone(tiny_pair):
    """CPU. ``mega serve --compile``: the static cache's decode step traced by torch.compile
    (aot_eager: the traced graph runs without generated code) gives the eager tokens, compiled
    twice (the first bucket's step, then one with a dynamic batch dimension), both when the
    worker is made (every window size run once), not once per step nor while requests wait."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    _, model, config = tiny_pair
    engine = engine_for(model, config)
    batch = [GenerationRequest(PROMPTS[0], 12), GenerationRequest(PROMPTS[1], 15, sampling=SamplingParams(top_k=5, seed=2)),
             GenerationRequest(PROMPTS[4], 6)]
    alone = [engine.generate([request])[0] for request in batch]
    compiled = []
    aot_eager = aot_autograd(fw_compiler=boxed_nop)

    def counting_backend(graph, example_inputs):
        compiled.append(graph)
        return aot_eager(graph, example_inputs)

    torch._dynamo.reset()
    worker = ContinuousBatchingWorker(engine, max_batch_size=3, max_num_tokens=3 * POSITIONS, static_cache=True,
                                      compile_backend=counting_backend)
    assert len(compiled) == 2
    together = staggered_on(worker, batch)
    assert [(r.tokens, r.finish_reason) for r in together] == [(r.tokens, r.finish_reason) for r in alone]
    assert len(compiled) == 2


@pytest.mark.parametrize(("budget", "static"), [(4096, False), (40, False), (4096, True)],
                         ids=["one-prefill", "budget", "static"])
def test_prompts_admitted_together_are_prefilled_together_and_get_what_each_gets_alone(tiny_pair, monkeypatch, budget,
                                                                                       static):
    """All five requests queue before the worker starts, so one step admits them: the prompts
    without prompt log-probabilities are prefilled right-padded in one forward (or, with a
    40-token budget, three and a lone one), the others apart from them; the same into
    static-cache slots."""
    import mega.inference.engine.continuous as continuous

    _, model, config = tiny_pair
    engine = engine_for(model, config)
    batch = requests() + [GenerationRequest(PROMPTS[3][:13], 6), GenerationRequest(PROMPTS[0][:4], 5)]
    alone = [engine.generate([request])[0] for request in batch]
    monkeypatch.setattr(continuous, "PREFILL_TOKENS", budget)
    worker = ContinuousBatchingWorker(engine, max_batch_size=8, max_num_tokens=8 * POSITIONS if static else 256,
                                      block_size=8, static_cache=static)
    prefills = []
    together = worker._prefill_together
    monkeypatch.setattr(worker, "_prefill_together", lambda group: (prefills.append(len(group)), together(group)))

    async def run():
        loop = asyncio.get_running_loop()
        jobs = [Job([request], loop) for request in batch]
        for job in jobs:
            worker.submit(job)
        worker.start()
        return [(await job.done)[0] for job in jobs]

    try:
        results = asyncio.run(run())
    finally:
        worker.stop()
    assert prefills == ([4] if budget == 4096 else [3]), prefills
    for expected, got in zip(alone, results, strict=True):
        assert got.tokens == expected.tokens and got.finish_reason == expected.finish_reason
        if expected.logprobs is not None:
            assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=1e-5)
    assert free_blocks(worker.allocator) == worker.allocator.num_blocks


@pytest.mark.parametrize("static", [False, True], ids=["paged", "static"])
def test_prompts_wanting_logprobs_are_prefilled_in_one_forward(llama, monkeypatch, static):
    """RL rollouts ask every token's log-probability: four such prompts (sampled, seeded, as a
    rollout group draws them) admitted at one step are prefilled right-padded in one forward
    keeping every position's logits, and each gets the tokens and log-probabilities it gets alone."""
    model, config = llama
    engine = engine_for(model, config)
    batch = [GenerationRequest(prompt, 6, sampling=SamplingParams(seed=index), logprobs=True)
             for index, prompt in enumerate([PROMPTS[0], PROMPTS[2], PROMPTS[3][:9], PROMPTS[4]])]
    alone = [engine.generate([request])[0] for request in batch]
    worker = ContinuousBatchingWorker(engine, max_batch_size=4, max_num_tokens=4 * POSITIONS, block_size=8,
                                      static_cache=static)
    forwards = []
    forward = worker.kv.forward
    monkeypatch.setattr(worker.kv, "forward", lambda sequences, *rest, **named: (
        forwards.append(tokens.shape if (tokens := rest[0]) is not None else None), forward(sequences, *rest, **named))[1])
    together = worker.run_to_completion(batch)
    assert forwards[0] == (4, len(PROMPTS[3][:9])), forwards  # the first forward: every prompt, padded
    assert all(shape[1] == 1 for shape in forwards[1:]), forwards  # then one token per row per step
    for expected, got in zip(alone, together, strict=True):
        assert got.tokens == expected.tokens and got.finish_reason == expected.finish_reason
        assert len(got.logprobs) == len(got.tokens) - 1
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=1e-5, rtol=0)


def test_a_short_request_overtakes_a_long_one(llama):
    model, config = llama
    worker = ContinuousBatchingWorker(engine_for(model, config), max_batch_size=8)
    worker.start()

    async def run():
        loop = asyncio.get_running_loop()
        long = Job([GenerationRequest(PROMPTS[0], 50)], loop, stream=True)
        worker.submit(long)
        while (await long.events.get())[0] != "token":
            pass
        short = Job([GenerationRequest(PROMPTS[1], 2)], loop)
        worker.submit(short)
        await short.done
        return long.done.done()

    try:
        long_was_done = asyncio.run(run())
    finally:
        worker.stop()
    assert not long_was_done  # the short one joined the running batch and finished first


def test_requests_larger_than_the_cache_are_refused(llama):
    model, config = llama
    worker = ContinuousBatchingWorker(engine_for(model, config), max_batch_size=2, max_num_tokens=32, block_size=16)
    worker.check(GenerationRequest([1] * 16, 16))
    with pytest.raises(GenerationError, match="--max-num-tokens"):
        worker.check(GenerationRequest([1] * 16, 17))
