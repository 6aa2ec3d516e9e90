"""The paged KV cache bounds a sliding-window layer's memory per sequence by its window: each
sequence keeps a ring of ``ceil((window + speculative tokens) / block_size)`` blocks on those
layers (gpt-oss's every other layer), whatever its length, and the one loop still gives the greedy
tokens of the model run over each whole sequence without a cache (the window a mask on every key):
sequences of different lengths joining a running batch as others finish, prompts prefilled
together (right-padded) or in chunks shorter and longer than the window, decoding far past the
window, and speculative decoding (rolled-back drafts). Every block is back in its pool at the end.
CPU (a tiny random gpt-oss, fp32), pinned so it passes on a GPU machine as well."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from mega.core.build import build_stage
from mega.inference.engine import GenerationEngine, GenerationRequest
from mega.inference.engine.continuous import ContinuousBatchingWorker
from mega.inference.engine.paged_window_cache import WindowedBlockAllocator
from mega.models.gpt_oss.family import FAMILY, PRESETS

WINDOW, POSITIONS = 4, 64
# Different lengths and endings: with a batch of 2 the later ones join as the earlier finish.
REQUESTS = [(list(range(3, 14)), 30), ([7, 9, 2], 12), ([40, 41, 5, 60, 61, 62, 8], 20), ([90, 91], 25)]


def tiny_gpt_oss(**changes) -> GenerationEngine:
    config = dataclasses.replace(PRESETS["tiny"], num_layers=3, hidden_size=32, ffn_hidden_size=32,
                                 moe_ffn_hidden_size=32, kv_channels=8, vocab_size=128, seq_length=POSITIONS,
                                 max_position_embeddings=POSITIONS, sliding_window=WINDOW, init_method_std=0.2,
                                 **changes)
    with torch.device("cpu"):
        torch.manual_seed(0)
        model = build_stage(FAMILY, config, training=False).eval()
    return GenerationEngine(model, vocab_size=config.vocab_size, max_positions=POSITIONS)


@pytest.fixture(scope="module")
def engine():
    engine = tiny_gpt_oss()
    assert engine.layer_windows == {0: WINDOW, 2: WINDOW}  # layer 1 attends to everything
    return engine


def uncached_greedy(engine, requests) -> list[list[int]]:
    """Greedy tokens of the model over each whole sequence at every step, no cache at all."""
    results = []
    with torch.inference_mode():
        for prompt, new_tokens in requests:
            tokens = list(prompt)
            for _ in range(new_tokens):
                logits = engine.forward(torch.tensor([tokens]), torch.arange(len(tokens))[None], None)
                tokens.append(int(logits[-1, 0].argmax()))
            results.append(tokens)
    return results


@pytest.fixture(scope="module")
def expected(engine):
    return uncached_greedy(engine, REQUESTS)


def run(engine, block_size: int, batched_tokens: int | None = None, speculator=None, max_batch_size: int = 2):
    """The loop's tokens, checking at every forward that no sequence holds more sliding blocks
    than its ring and that the sliding pool is of ``max_batch_size`` rings."""
    worker = ContinuousBatchingWorker(engine, max_batch_size=max_batch_size, max_num_tokens=len(REQUESTS) * POSITIONS,
                                      block_size=block_size, max_num_batched_tokens=batched_tokens,
                                      speculator=speculator)
    allocator = worker.allocator
    assert isinstance(allocator, WindowedBlockAllocator)
    rolled_back = 0 if speculator is None else speculator.num_tokens
    ring = -(-(WINDOW + rolled_back) // block_size)
    assert allocator.ring_blocks == ring and allocator.sliding.num_blocks == max_batch_size * ring
    forward, held = worker.kv.forward, []

    def checked_forward(sequences, *args, **kwargs):
        for sequence in sequences:
            assert len(sequence.blocks.sliding) <= ring, (len(sequence.blocks.sliding), ring)
            held.append(len(sequence.blocks.sliding))
        return forward(sequences, *args, **kwargs)

    worker.kv.forward = checked_forward
    results = worker.run_to_completion([GenerationRequest(prompt, new) for prompt, new in REQUESTS])
    # Every block back in its pool; the sliding layers' pools are of the rings, the full one's of all.
    assert len(allocator._free) == allocator.num_blocks
    assert len(allocator.sliding._free) == allocator.sliding.num_blocks
    pools = {number: layer.keys.shape[0] for number, layer in worker.kv.cache._sliding.items()}
    assert pools == dict.fromkeys(engine.layer_windows, max_batch_size * ring)
    full = {number: layer.keys.shape[0] for number, layer in worker.kv.cache._layers.items()}
    assert full == {number: allocator.num_blocks for number in range(3) if number not in engine.layer_windows}
    assert max(held) == ring  # the long sequences did fill their rings (and wrapped round them)
    return [result.tokens for result in results]


@pytest.mark.parametrize("block_size", [4, 2])  # a ring of one block (the window exactly), and of two
def test_rings_of_the_window_decode_the_whole_sequences_tokens(engine, expected, block_size):
    assert run(engine, block_size) == expected
    # All four at once: prompts of four lengths prefilled together, right-padded.
    assert run(engine, block_size, max_batch_size=4) == expected


@pytest.mark.parametrize("batched_tokens", [3, 7])  # chunks shorter and longer than the window
def test_chunked_prefill_through_the_rings(engine, expected, batched_tokens):
    assert run(engine, 2, batched_tokens=batched_tokens) == expected


def test_speculative_decoding_rolls_back_inside_the_ring(engine, expected):
    """A ring of the window plus K positions: what a rejected draft rolls back is still there."""
    from mega.inference.engine.speculative import NgramProposer, Speculator

    assert run(engine, 2, speculator=Speculator(NgramProposer(), 3)) == expected


def test_a_model_whose_every_layer_slides_keeps_rings_only():
    """(Mistral's ``--sliding-window``, gpt-oss without full layers): no pool of every position."""
    engine = tiny_gpt_oss(window_attn_skip_freq=None)
    assert engine.layer_windows == {0: WINDOW, 1: WINDOW, 2: WINDOW}
    assert run(engine, 2) == uncached_greedy(engine, REQUESTS)


def test_prefix_caching_is_off_and_said(engine, caplog):
    with caplog.at_level(logging.INFO, logger="mega.inference.engine.paged_window_cache"):
        worker = ContinuousBatchingWorker(engine, max_batch_size=2, max_num_tokens=2 * POSITIONS, prefix_caching=True)
    assert not worker.prefix_caching
    assert "prefix caching is off for models with sliding-window layers" in caplog.text
