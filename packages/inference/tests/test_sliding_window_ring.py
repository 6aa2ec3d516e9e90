"""The static KV cache keeps a ring of its window for each sliding-window layer (gpt-oss's every
other layer): the memory per sequence of those layers is the window's, and the one loop gives the
tokens of the paged cache (every key kept, the window a mask), greedy, for prompts of different
lengths prefilled together (right-padded), prefilled in chunks shorter and longer than the window,
and decoded past it; with speculative decoding (slots rolled back) the slots stay whole. CPU (a
tiny random gpt-oss, fp32), so it passes on a GPU machine as well."""

from __future__ import annotations

import pytest
import torch

from mega.core.build import build_stage
from mega.inference.engine import GenerationEngine, GenerationRequest
from mega.inference.engine.continuous import ContinuousBatchingWorker
from mega.models.gpt_oss.family import FAMILY, PRESETS

WINDOW, POSITIONS = 4, 64
PROMPTS = [list(range(3, 14)), [7, 9, 2], [40, 41, 5, 60, 61, 62, 8]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def engine():
    import dataclasses

    config = dataclasses.replace(PRESETS["tiny"], num_layers=3, hidden_size=32, ffn_hidden_size=32,
                                 moe_ffn_hidden_size=32, kv_channels=8, vocab_size=128, seq_length=POSITIONS,
                                 max_position_embeddings=POSITIONS, sliding_window=WINDOW, init_method_std=0.2)
    with torch.device("cpu"):
        torch.manual_seed(0)
        model = build_stage(FAMILY, config, training=False).eval()
    return GenerationEngine(model, vocab_size=config.vocab_size, max_positions=POSITIONS)


def run(engine, static: bool, batched_tokens: int | None = None, speculator=None):
    worker = ContinuousBatchingWorker(engine, max_batch_size=len(PROMPTS), max_num_tokens=len(PROMPTS) * POSITIONS,
                                      static_cache=static, max_num_batched_tokens=batched_tokens,
                                      speculator=speculator)
    results = worker.run_to_completion([GenerationRequest(prompt, NEW_TOKENS) for prompt in PROMPTS])
    return [result.tokens for result in results], worker


def test_rings_bound_the_sliding_layers_and_decode_as_the_paged_cache(engine):
    assert engine.layer_windows == {0: WINDOW, 2: WINDOW}  # layer 1 attends to everything
    expected, _ = run(engine, static=False)
    assert all(len(tokens) == len(prompt) + NEW_TOKENS for tokens, prompt in zip(expected, PROMPTS, strict=True))
    for batched_tokens in (None, 3, 6):  # all at once (padded together), chunks under and over the window
        got, worker = run(engine, static=True, batched_tokens=batched_tokens)
        assert got == expected, batched_tokens
    pools = {number: tuple(layer.keys.shape[:2]) for number, layer in worker.kv.cache._layers.items()}
    assert pools == {0: (3, WINDOW + 1), 1: (3, POSITIONS), 2: (3, WINDOW + 1)}


def test_speculation_keeps_whole_slots(engine):
    """Rejected drafts roll a slot back, which a ring cannot (it overwrote what the slot still
    sees): with a speculator the static cache keeps whole slots, and greedy tokens stay the same."""
    from mega.inference.engine.speculative import NgramProposer, Speculator

    expected, _ = run(engine, static=False)
    got, worker = run(engine, static=True, speculator=Speculator(NgramProposer(), 3))
    assert got == expected
    assert all(layer.keys.shape[1] == POSITIONS for layer in worker.kv.cache._layers.values())
