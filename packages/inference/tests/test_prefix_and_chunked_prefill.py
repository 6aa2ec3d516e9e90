"""Prefix caching and chunked prefill in continuous batching: outputs equal the lock-step engine's
(each request alone), a request sharing a cached 512-token prefix prefills only its suffix,
eviction under a small cache changes no output, and prompts prefilled in chunks between decode
steps give what whole prefills give (prompt log-probabilities included)."""

from __future__ import annotations

import asyncio
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import POSITIONS, VOCAB, hf_tiny, mega_from_hf  # noqa: E402

from mega.inference.engine import GenerationEngine, GenerationRequest  # noqa: E402
from mega.inference.engine.continuous import ContinuousBatchingWorker  # noqa: E402
from mega.inference.engine.sampling import SamplingParams  # noqa: E402
from mega.inference.engine.worker import Job  # noqa: E402

LONG_POSITIONS = 600


@pytest.fixture(scope="module")
def engine():
    model, config = mega_from_hf(hf_tiny("llama"), "llama")
    return GenerationEngine(model, vocab_size=config.vocab_size, max_positions=POSITIONS)


@pytest.fixture(scope="module")
def long_engine():
    """A tiny LLaMA with room for a 512-token prefix."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=LONG_POSITIONS, initializer_range=0.1)).eval()
    model, config = mega_from_hf(hf, "llama")
    return GenerationEngine(model, vocab_size=config.vocab_size, max_positions=LONG_POSITIONS)


def run(worker: ContinuousBatchingWorker, waves: list[list[GenerationRequest]]):
    """Each wave's requests submitted together, once the wave before has finished."""
    async def go():
        loop = asyncio.get_running_loop()
        results = []
        for wave in waves:
            jobs = [Job([request], loop) for request in wave]
            for job in jobs:
                worker.submit(job)
            results += [(await job.done)[0] for job in jobs]
        return results

    worker.start()
    try:
        return asyncio.run(go())
    finally:
        worker.stop()


def assert_same(got, expected):
    for want, have in zip(expected, got, strict=True):
        assert have.tokens == want.tokens and have.finish_reason == want.finish_reason
        if want.logprobs is not None:
            torch.testing.assert_close(torch.tensor(have.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("static", [False, True], ids=["paged", "static"])
def test_a_shared_512_token_prefix_is_prefilled_once(long_engine, static):
    """CPU. On the paged cache the second request shares the first's blocks; on the static KV
    cache the prefix's keys are copied from the first request's slot into its own."""
    rng = random.Random(0)
    prefix = [rng.randrange(VOCAB) for _ in range(512)]
    first = GenerationRequest(prefix + [rng.randrange(VOCAB) for _ in range(30)], 6)
    suffix = [rng.randrange(VOCAB) for _ in range(20)]
    second = GenerationRequest(prefix + suffix, 8, sampling=SamplingParams(temperature=0.8, top_k=20, seed=2))
    expected = [long_engine.generate([request])[0] for request in (first, second)]
    worker = ContinuousBatchingWorker(long_engine, max_batch_size=2, max_num_tokens=2 * LONG_POSITIONS,
                                      prefix_caching=True, static_cache=static)
    prefilled = []
    finish_first = worker._decode_step.on_finish

    def on_finish(sequence):  # what was prefilled when each request ended
        prefilled.append(worker.prefilled_tokens)
        finish_first(sequence)

    worker._decode_step.on_finish = on_finish
    got = run(worker, [[first], [second]])
    assert_same(got, expected)
    assert prefilled == [len(first.prompt), len(first.prompt) + len(suffix)]  # the second: its suffix only
    assert worker.metrics.prefix_hit_tokens == 512
    assert "mega_prefix_cache_hits_total 512" in worker.metrics.render()


@pytest.mark.parametrize("static", [False, True], ids=["paged", "static"])
def test_prefix_caching_and_eviction_change_no_output(engine, static):
    """CPU. Prompts sharing prefixes (and prompt log-probabilities, which prefill whole) through a
    cache of 12 eight-token blocks (or two static slots): cached prefixes are shared, evicted
    and their blocks (slots) reused."""
    rng = random.Random(1)
    prefixes = [[rng.randrange(VOCAB) for _ in range(24)] for _ in range(3)]
    waves = []
    for wave in range(4):
        batch = []
        for k in range(2):
            prompt = prefixes[(wave + k) % 3] + [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 9))]
            sampling = SamplingParams(temperature=0.9, seed=wave * 2 + k) if k else SamplingParams(top_k=1)
            batch.append(GenerationRequest(prompt, rng.randrange(3, 9), sampling=sampling, logprobs=wave == 3 and k == 0))
        waves.append(batch)
    expected = [engine.generate([request])[0] for wave in waves for request in wave]
    worker = ContinuousBatchingWorker(engine, max_batch_size=2, max_num_tokens=2 * POSITIONS if static else 96,
                                      block_size=8, prefix_caching=True, static_cache=static)
    got = run(worker, waves)
    assert_same(got, expected)
    assert worker.allocator.hit_tokens > 0 and worker.allocator.evicted_blocks > 0
    if not static:
        assert worker.allocator.free_blocks == worker.allocator.num_blocks  # every block released
    without = ContinuousBatchingWorker(engine, max_batch_size=2, max_num_tokens=2 * POSITIONS, block_size=8,
                                       static_cache=static)
    assert_same(run(without, waves), expected)
    assert worker.prefilled_tokens < without.prefilled_tokens  # the cached prefixes were not prefilled again


def test_one_token_prefills_leave_the_decode_views_alone(engine):
    """CPU. A one-token prompt, and a prompt cached but for its last token, are prefills even
    though each brings one token: they read their own blocks, and the rows decoding beside them
    keep their decode views (the old rule took such a forward for a decode step and gathered the
    prompt into row 0's view, so the decoding sequence there was gathered again at its next step;
    on a server that made a one-token request cost more than its forward). Every request gets
    the tokens it gets alone."""
    from mega.inference.engine.worker import Collector

    long = GenerationRequest(list(range(30, 50)), 10)
    one_token = GenerationRequest([7], 4)
    repeated = GenerationRequest(list(range(30, 39)), 4)  # its first 8 tokens: the long prompt's first block
    expected = [engine.generate([request])[0] for request in (long, one_token, repeated)]
    worker = ContinuousBatchingWorker(engine, max_batch_size=4, block_size=8, prefix_caching=True)
    first, second = Collector([long], None, None), Collector([one_token, repeated], None, None)
    worker.submit(first)
    for _ in range(3):  # prefilled, then decoding on row 0 of the views
        worker._step(worker._admit())
    cache, decoding = worker.kv.cache, worker._running[0].number
    assert cache.view_ids[0] == decoding
    worker.submit(second)
    worker._step(worker._admit())  # the long row decodes, the two join
    assert cache.view_ids[0] == decoding and cache.view_lengths[0] == len(long.prompt) + 3
    assert worker.allocator.hit_tokens == 8  # the repeated prompt prefilled its last token only
    while worker._has_work():
        worker._step(worker._admit())
    assert_same(first.results + second.results, expected)


@pytest.mark.parametrize("prefix_caching,static", [(False, False), (True, False), (True, True)],
                         ids=["paged", "prefix-caching", "static-prefix-caching"])
def test_chunked_prefill_equals_whole_prefill(engine, prefix_caching, static):
    """A budget of 6 tokens a step: the long prompts are prefilled in chunks while the short
    request decodes; tokens and prompt log-probabilities are those of whole prefills."""
    requests = [GenerationRequest([7, 9], 20),
                GenerationRequest(list(range(30, 70)), 6, logprobs=True, top_logprobs=2),
                GenerationRequest(list(range(100, 127)), 7, sampling=SamplingParams(temperature=0.7, seed=4)),
                GenerationRequest(list(range(100, 120)), 0, logprobs=True)]
    expected = [engine.generate([request])[0] for request in requests]
    worker = ContinuousBatchingWorker(engine, max_batch_size=4, max_num_tokens=512, block_size=8,
                                      prefix_caching=prefix_caching, max_num_batched_tokens=6, static_cache=static)
    chunks = []
    prefill = worker._prefill
    worker._prefill = lambda sequence, count: (chunks.append(count), prefill(sequence, count))
    got = run(worker, [requests[:1], requests[1:]])
    assert_same(got, expected)
    assert max(chunks) <= 6 and len(chunks) > len(requests)  # prompts went in several chunks


def test_serve_refuses_flags_that_cannot_work_together(tmp_path, capsys, monkeypatch):
    from mega.inference.cli.serve import build_parser, main

    for argv, words in [(["--max-num-batched-tokens", "4", "--max-batch-size", "8"], "at least --max-batch-size"),
                        (["--max-model-len", "0"], "--max-model-len must be positive"),
                        (["--request-timeout", "-1"], "--request-timeout must be positive")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["--load", str(tmp_path), *argv])
        assert words in capsys.readouterr().err + str(exit_info.value.code), argv
    # A web stack that cannot import (fastapi 0.165 without opentelemetry-api) ends it before any loading.
    monkeypatch.setitem(sys.modules, "mega.inference.http.server", None)
    with pytest.raises(SystemExit, match="needs the Python package 'mega.inference.http.server'.*opentelemetry-api"):
        main(["--load", str(tmp_path)])
    args = build_parser().parse_args(["--load", str(tmp_path)])
    assert args.enable_prefix_caching is None and args.max_request_bytes == 4 << 20 and args.host == "127.0.0.1"


@pytest.mark.parametrize("static", [False, True], ids=["paged", "static"])
def test_generated_logprobs_without_the_prompts(engine, static):
    """CPU. ``prompt_logprobs=False`` (chat replies, completions without echo, RL rollouts): the
    generated tokens and their log-probabilities (top ones too) are those of a request scoring its
    prompt as well, the prompt's places are None, and the prompt prefills as one asking nothing:
    through the prefix cache (a shared prefix is a hit) and with the prompts prefilled together."""
    prefix = list(range(40, 56))
    prompts = [prefix + [3, 9, 27], prefix + [5, 25], [7, 8, 9]]
    sampling = SamplingParams(temperature=0.9, seed=4)

    def requests(scored: bool) -> list[GenerationRequest]:
        return [GenerationRequest(p, 6, sampling=sampling, logprobs=True, top_logprobs=2, prompt_logprobs=scored)
                for p in prompts]

    expected = [engine.generate([request])[0] for request in requests(True)]
    worker = ContinuousBatchingWorker(engine, max_batch_size=4, max_num_tokens=4 * POSITIONS if static else 256,
                                      block_size=8, prefix_caching=True, static_cache=static)
    got = run(worker, [requests(False)[:1], requests(False)[1:]])
    for have, want in zip(got, expected, strict=True):
        start = want.prompt_length - 1
        assert have.tokens == want.tokens and have.logprobs[:start] == [None] * start
        torch.testing.assert_close(torch.tensor(have.logprobs[start:]), torch.tensor(want.logprobs[start:]),
                                   atol=1e-5, rtol=0)
        assert [[t for t, _ in top] for top in have.top_logprobs[start:]] == \
            [[t for t, _ in top] for top in want.top_logprobs[start:]]
    assert worker.allocator.hit_tokens == 16  # the second prompt shared the first's two blocks
