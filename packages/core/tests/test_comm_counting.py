"""What a layout hands to each collective in a step equals the analytical count."""

from __future__ import annotations

import pytest
import torch

from mega.core.parallel import CommCounter, ParallelConfig, ParallelGroups
from mega.testing.tiny_lm import PLAN, TinyConfig, TinyLM

CONFIG = TinyConfig(layers=3)
BATCH = 2


def count_transformer_layers(tp, sequence_parallel):
    from mega.core.parallel import apply_tensor_parallel
    from mega.core.parallel.collectives import split_along

    groups = ParallelGroups(ParallelConfig(tp=tp, sequence_parallel=sequence_parallel))
    torch.manual_seed(0)
    model = apply_tensor_parallel(TinyLM(CONFIG), PLAN, groups)
    x = torch.randn(CONFIG.seq, BATCH, CONFIG.hidden)
    if sequence_parallel:
        x = split_along(x, groups.tp, 0)
    x.requires_grad_(True)
    with CommCounter() as forward:
        y = x
        for layer in model.layers:
            y = layer(y)
    with CommCounter() as backward:
        y.sum().backward()
    return forward.stats, backward.stats


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_transformer_layer_collectives_match_the_analysis(worlds, sequence_parallel):
    tp, layers = 2, CONFIG.layers
    activation = BATCH * CONFIG.seq * CONFIG.hidden  # b*s*h, the full (unsplit) activation
    if sequence_parallel:
        # Each all-reduce becomes an all-gather plus a reduce-scatter of the same volume.
        expected = {("all_gather", "tp"): 2 * layers, ("reduce_scatter", "tp"): 2 * layers}
    else:
        expected = {("all_reduce", "tp"): 2 * layers}
    for forward, backward in worlds.run(tp, count_transformer_layers, tp, sequence_parallel):
        for stats in (forward, backward):
            assert {key: s.calls for key, s in stats.items()} == expected
            assert {key: s.elements for key, s in stats.items()} == {
                key: calls * activation for key, calls in expected.items()}
            assert all(s.bytes == 4 * s.elements for s in stats.values())


def test_a_counter_is_scoped_and_a_single_process_hands_nothing_over():
    from mega.core.parallel.collectives import active_counter, all_reduce

    groups = ParallelGroups(ParallelConfig())
    with CommCounter() as outer:
        with CommCounter() as inner:
            assert active_counter() is inner
            all_reduce(torch.ones(4), groups.tp)  # size-1 group: no collective, nothing counted
        assert active_counter() is outer
    assert active_counter() is None
    assert outer.stats == {} and inner.stats == {}
