"""The device-side sampler (numbers drawn ahead, no host read per token) gives the host-side
sampler's tokens and log-probabilities (tests/reference_sampler.py: the engine's sampler before
it moved) for every sampling option and seed, in mixed batches, with GPT-2, LLaMA and Mixtral."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from reference_sampler import HostSampler  # noqa: E402
from tiny_models import POSITIONS, VOCAB, hf_tiny, mega_from_hf  # noqa: E402

import mega.inference.engine.decode_step as decode_step  # noqa: E402
import mega.inference.engine.sampling as sampling  # noqa: E402
from mega.inference.engine import GenerationEngine, GenerationRequest  # noqa: E402
from mega.inference.engine.sampling import GREEDY, SamplingParams  # noqa: E402

OPTIONS = [
    GREEDY,
    SamplingParams(seed=1),  # temperature 1, every token
    SamplingParams(temperature=0.7, seed=2),
    SamplingParams(top_k=5, seed=3),
    SamplingParams(top_p=0.8, seed=4),
    SamplingParams(temperature=1.3, top_k=40, seed=2**64 - 1),
    SamplingParams(temperature=0.9, top_p=0.95, seed=5, presence_penalty=0.7, frequency_penalty=0.4),
    SamplingParams(seed=6, logit_bias=((3, 5.0), (17, -100.0), (VOCAB - 1, 2.0))),
    SamplingParams(top_k=1, logit_bias=((42, 3.0),), frequency_penalty=1.0),  # greedy with adjustments
]


def mega_mixtral():
    """A tiny Mixtral (4 experts, top-2), randomly initialised: both samplers see the same model."""
    import transformers

    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.core.plugins import get_plugins
    from mega.inference.loader import build_model

    hf_config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                           num_experts_per_tok=2, max_position_embeddings=POSITIONS)
    family = get_plugins().models.get("mixtral")
    config = family.hf_mapping.config_from_hf(hf_config.to_dict())
    torch.manual_seed(0)
    model = build_model(family, config, ParallelGroups(ParallelConfig()), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        for param in model.parameters():  # a spread of logits worth sampling from
            param.normal_(0, 0.2)
    return model, config


@pytest.fixture(scope="module", params=["gpt2", "llama", "mixtral"])
def engine(request):
    if request.param == "mixtral":
        model, config = mega_mixtral()
    else:
        model, config = mega_from_hf(hf_tiny(request.param), {"gpt2": "gpt"}.get(request.param, request.param))
    return GenerationEngine(model, vocab_size=config.vocab_size, max_positions=POSITIONS)


def batch() -> list[GenerationRequest]:
    """Every option, prompts of different lengths (rows still in their prompts draw nothing)."""
    prompts = [[5, 17, 42, 8, 99, 3, 1], [7], [200, 13, 60], list(range(30, 50)), [11, 12]]
    return [GenerationRequest(prompts[i % len(prompts)], 12 if i == 1 else 3 + i % 4, sampling=params, logprobs=True)
            for i, params in enumerate(OPTIONS)]


def test_device_sampler_equals_the_host_sampler(engine, monkeypatch):
    monkeypatch.setattr(sampling, "DRAWS_AHEAD", 4)  # streams drawn ahead several times over
    device_side = engine.generate(batch())
    monkeypatch.setattr(decode_step, "Sampler", HostSampler)
    host_side = engine.generate(batch())
    for got, want in zip(device_side, host_side, strict=True):
        assert got.tokens == want.tokens
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=0, rtol=0)
    # One request alone draws what it draws in the batch (its stream is its own).
    alone = engine.generate([batch()[5]])[0]
    assert alone.tokens == device_side[5].tokens
    assert len(device_side[1].generated) > 2 * sampling.DRAWS_AHEAD


def test_a_batch_without_top_k_or_top_p_skips_the_filters_and_equals_the_host_sampler(engine, monkeypatch):
    """No row filters its tokens (the RL rollouts' case): the sampler skips the filters' steps
    (Sampler.filters), with the host sampler's tokens and log-probabilities bit for bit."""
    unfiltered = [r for r in batch() if not r.sampling.top_k and not r.sampling.top_p]
    assert len(unfiltered) == 3 and not sampling.Sampler([r.sampling for r in unfiltered], engine.device).filters
    device_side = engine.generate(unfiltered)
    monkeypatch.setattr(decode_step, "Sampler", HostSampler)
    host_side = engine.generate(unfiltered)
    for got, want in zip(device_side, host_side, strict=True):
        assert got.tokens == want.tokens
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=0, rtol=0)
