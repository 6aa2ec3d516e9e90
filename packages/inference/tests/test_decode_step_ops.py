"""What a static-cache decode step asks of the device, counted on the CPU.

On a GPU each ATen op of a decode step that is not a view is a kernel of the step's CUDA graph,
and at batch 1 a graph of small kernels is bound by their count rather than by memory
bandwidth (issue 35: ~130 us per layer and step on an H200, where reading the layer's weights
takes ~40). The cache's positions and mask are made once per step, the rotary angles once per
forward, a lone bias mask reaches the kernel as it is; these bounds keep it so.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import POSITIONS  # noqa: E402

from mega.inference.engine import GenerationEngine  # noqa: E402
from mega.inference.engine.slot_kv_cache import DecodeGraphs, SlotKVCache  # noqa: E402
from mega.testing.copy_counts import CopyCounts  # noqa: E402

# Per layer (19, in fp32 and bf16 alike; 39 at c14b0b4, before the cache's positions and mask,
# the angles and the rotation's halves were made once): 2 norms, 4 linears (QKV, projection, gate+up, down),
# SwiGLU's silu and product, 2 residual adds, the rotation of the query and of the key (3 each),
# the keys' and values' writes into the cache, the attention. Outside the layers (26): the
# embedding, final norm, output layer, argmax, the window's positions and mask, the angles.
LAYER_BOUND = 19
OUTSIDE_BOUND = 26


@pytest.mark.parametrize("tiny_pair", [("llama", "llama")], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_greedy_static_decode_step_stays_within_its_kernel_count(tiny_pair, dtype):
    """CPU."""
    _, model, config = tiny_pair
    model = copy.deepcopy(model).to(dtype)  # the fixture's model is shared by the session's tests
    engine = GenerationEngine(model, vocab_size=config.vocab_size, max_positions=POSITIONS)
    steps = DecodeGraphs(engine, SlotKVCache(4, POSITIONS, engine.device, dtype), use_cuda_graphs=False)
    tokens, cached = torch.tensor([[5], [6], [7], [8]]), torch.tensor([3, 9, 0, 12])
    layers = list(model.decoder.layers.values())
    with torch.inference_mode():
        steps.greedy(tokens, cached)  # the first step allocates the cache
        with CopyCounts(within=layers) as ops:
            steps.greedy(tokens, cached)
    inside, outside = ops.scoped_device_ops, ops.device_ops - ops.scoped_device_ops
    per_layer = sum(inside.values()) / len(layers)
    assert per_layer <= LAYER_BOUND, f"{per_layer} ops per layer: {dict(inside)}"
    assert sum(outside.values()) <= OUTSIDE_BOUND, dict(outside)
