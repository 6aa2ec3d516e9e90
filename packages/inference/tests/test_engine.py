"""The engine against Hugging Face ``generate``: greedy tokens equal, log-probabilities within 1e-5,
single prompts and batches of mixed lengths; seeded sampling reproduces; stop rules; limits."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import POSITIONS, VOCAB  # noqa: E402

transformers = pytest.importorskip("transformers")

from mega.inference.engine import GenerationEngine, GenerationError, GenerationRequest  # noqa: E402
from mega.inference.engine.sampling import SamplingParams  # noqa: E402
from mega.inference.engine.stopping import StopRules  # noqa: E402
from mega.models.blocks.kv_cache import KVCache  # noqa: E402

EOS = VOCAB - 1
PAD = 0
NEW_TOKENS = 12
PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [7, 200], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [150, 2, 77]]


def engine_for(model, config) -> GenerationEngine:
    return GenerationEngine(model, vocab_size=config.vocab_size, max_positions=config.max_position_embeddings)


def hf_greedy(hf_model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Hugging Face's greedy continuations of a left-padded batch, each cut after its end token."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                            pad_token_id=PAD, eos_token_id=EOS)
    results = []
    for prompt, row in zip(prompts, out.tolist(), strict=True):
        generated = row[width:]
        if EOS in generated:
            generated = generated[: generated.index(EOS) + 1]
        results.append(prompt + generated)
    return results


def hf_logprobs(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)


def greedy_requests(prompts, new_tokens=NEW_TOKENS, **options):
    return [GenerationRequest(p, new_tokens, stop=StopRules(stop_ids=frozenset({EOS})), **options) for p in prompts]


def test_greedy_single_prompt_equals_hugging_face(tiny_pair):
    hf_model, model, config = tiny_pair
    engine = engine_for(model, config)
    for prompt in PROMPTS[:2]:
        [result] = engine.generate(greedy_requests([prompt]))
        assert result.tokens == hf_greedy(hf_model, [prompt], NEW_TOKENS)[0]
        assert result.prompt_length == len(prompt)


def test_greedy_batch_of_mixed_lengths_equals_hugging_face_with_logprobs(tiny_pair):
    hf_model, model, config = tiny_pair
    results = engine_for(model, config).generate(greedy_requests(PROMPTS, logprobs=True))
    expected = hf_greedy(hf_model, PROMPTS, NEW_TOKENS)
    assert [r.tokens for r in results] == expected
    for result in results:
        assert len(result.logprobs) == len(result.tokens) - 1
        reference = hf_logprobs(hf_model, result.tokens)
        assert (torch.tensor(result.logprobs, dtype=torch.float64) - reference).abs().max() < 1e-5
        assert result.finish_reason == ("stop" if result.tokens[-1] == EOS else "length")


def test_kv_cache_forward_equals_full_forward(tiny_pair):
    _, model, config = tiny_pair
    tokens = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(tokens.shape[1])
        pieces = [model(tokens[:, :5], inference_cache=cache)]
        pieces += [model(tokens[:, i: i + 1], inference_cache=cache) for i in range(5, tokens.shape[1])]
    torch.testing.assert_close(torch.cat(pieces), full, rtol=1e-5, atol=1e-5)


def test_top_logprobs_are_the_most_likely_tokens(tiny_pair):
    hf_model, model, config = tiny_pair
    [result] = engine_for(model, config).generate(greedy_requests([PROMPTS[0]], 3, logprobs=True, top_logprobs=3))
    assert len(result.top_logprobs) == len(result.tokens) - 1
    with torch.no_grad():
        log_probs = torch.log_softmax(hf_model(torch.tensor([result.tokens])).logits[0, :-1], -1)
    for position, top in enumerate(result.top_logprobs):
        values, ids = log_probs[position].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in top]), values, atol=1e-5)
    # Greedy: the chosen token is the first alternative at every generated position.
    generated_tops = result.top_logprobs[result.prompt_length - 1:]
    assert [top[0][0] for top in generated_tops] == result.generated


def test_seeded_sampling_reproduces_whatever_the_batch(tiny_pair):
    _, model, config = tiny_pair
    engine = engine_for(model, config)
    params = SamplingParams(temperature=1.5, top_p=0.9, seed=123)
    alone = engine.generate([GenerationRequest(PROMPTS[0], 20, params)])[0].tokens
    again = engine.generate([GenerationRequest(PROMPTS[0], 20, params)])[0].tokens
    batched = engine.generate([GenerationRequest(PROMPTS[1], 20, SamplingParams(seed=7)),
                               GenerationRequest(PROMPTS[0], 20, params)])[1].tokens
    other_seed = engine.generate([GenerationRequest(PROMPTS[0], 20, SamplingParams(1.5, 0, 0.9, seed=124))])[0]
    assert alone == again == batched
    assert other_seed.tokens != alone


def test_top_k_one_is_greedy_and_sampling_stays_in_the_vocabulary(tiny_pair):
    _, model, config = tiny_pair
    engine = engine_for(model, config)
    greedy = engine.generate([GenerationRequest(PROMPTS[0], 10)])
    top1 = engine.generate([GenerationRequest(PROMPTS[0], 10, SamplingParams(temperature=3.0, top_k=1, seed=1))])
    assert greedy[0].tokens == top1[0].tokens
    hot = engine.generate([GenerationRequest(PROMPTS[0], 40, SamplingParams(temperature=100.0, seed=3))])[0]
    assert all(0 <= t < VOCAB for t in hot.generated)  # the padded rows 250..255 are never drawn
    assert len(set(hot.generated)) > 20  # a hot temperature spreads over the vocabulary


def test_stop_tokens_and_callbacks(tiny_pair):
    _, model, config = tiny_pair
    engine = engine_for(model, config)
    [free] = engine.generate([GenerationRequest(PROMPTS[0], 10)])
    stop_token = free.generated[3]
    streamed, finished = [], []
    results = engine.generate(
        [GenerationRequest(PROMPTS[0], 10, stop=StopRules(stop_ids=frozenset({stop_token}))),
         GenerationRequest(PROMPTS[1], 0, logprobs=True)],
        on_token=lambda i, token, logprob, top: streamed.append((i, token)),
        on_finish=lambda i, result: finished.append(i))
    stopped = results[0]
    assert stopped.generated == free.generated[: free.generated.index(stop_token) + 1]
    assert stopped.finish_reason == "stop"
    assert [t for i, t in streamed if i == 0] == stopped.generated
    # No tokens to generate: the prompt's log-probabilities only, and it finishes first.
    assert results[1].generated == [] and len(results[1].logprobs) == len(PROMPTS[1]) - 1
    assert finished == [1, 0]


def test_cancelled_request_ends_and_the_others_go_on(tiny_pair):
    _, model, config = tiny_pair
    engine = engine_for(model, config)
    requests = [GenerationRequest(PROMPTS[0], 20), GenerationRequest(PROMPTS[1], 20)]

    def cancel_first(i, token, logprob, top):
        if i == 0:
            requests[0].cancelled = True

    results = engine.generate(requests, on_token=cancel_first)
    assert results[0].finish_reason == "cancelled" and len(results[0].generated) == 1
    assert results[1].finish_reason == "length" and len(results[1].generated) == 20
    assert results[1].tokens == engine.generate([GenerationRequest(PROMPTS[1], 20)])[0].tokens


def test_limits_are_checked_against_the_model(tiny_pair):
    _, model, config = tiny_pair
    engine = engine_for(model, config)
    with pytest.raises(GenerationError, match=f"exceeds the model's {POSITIONS} positions"):
        engine.generate([GenerationRequest(PROMPTS[0], POSITIONS)])
    with pytest.raises(GenerationError, match="prompt is empty"):
        engine.generate([GenerationRequest([], 4)])
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        engine.generate([GenerationRequest([VOCAB], 4)])
    # Exactly the model's positions is fine.
    [result] = engine.generate([GenerationRequest(PROMPTS[0], POSITIONS - len(PROMPTS[0]))])
    assert len(result.tokens) == POSITIONS
