"""Activation recompute (full uniform/block, selective) changes memory, not numbers: the same
loss and gradients as without it, dropout included (the recomputed masks are the same)."""

from __future__ import annotations

import pytest
import torch

from mega.core.build import build_stage
from mega.core.parallel import ParallelConfig
from mega.core.parallel.random import MODEL_PARALLEL, RNGStatesTracker
from mega.models.gpt.family import FAMILY as GPT
from mega.models.llama.family import FAMILY as LLAMA

RECOMPUTE = {
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}
# How often each layer's forward runs in one step: recomputed layers run twice.
LAYER_FORWARDS = {"full-uniform-2": [2, 2, 2, 2], "full-block-1": [2, 1, 1, 1], "selective": [1, 1, 1, 1]}


def loss_and_grads(family, recompute: dict, *, rng_tracker=None, sequence_parallel=False):
    config = family.preset("tiny", num_layers=4, vocab_size=256, seq_length=16, hidden_dropout=0.1,
                           attention_dropout=0.1, **recompute)
    model = build_stage(family, config, seed=5, rng_tracker=rng_tracker,
                        parallel=ParallelConfig(sequence_parallel=sequence_parallel))
    calls = {"layer": [0] * 4, "core_attention": 0}
    for number, layer in model.decoder.layers.items():
        # Pre-hooks: torch stops a recompute once it has what backward needs, before a hook
        # after the forward would run.
        layer.register_forward_pre_hook(lambda *_, n=int(number): calls["layer"].__setitem__(n, calls["layer"][n] + 1))
    model.decoder.layers["0"].self_attention.core_attention.register_forward_pre_hook(
        lambda *_: calls.__setitem__("core_attention", calls["core_attention"] + 1))

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(123)  # the dropout masks
    if rng_tracker is not None:
        rng_tracker.set_states({MODEL_PARALLEL: torch.Generator().manual_seed(77).get_state()})
    loss = model.loss(model(ids), labels).mean()
    loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    return loss.detach(), grads, calls


@pytest.mark.parametrize("family", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_recompute_gives_the_same_loss_and_gradients(family, recompute):
    loss, grads, calls = loss_and_grads(family, {})
    assert calls == {"layer": [1, 1, 1, 1], "core_attention": 1}
    loss_r, grads_r, calls_r = loss_and_grads(family, RECOMPUTE[recompute])
    assert calls_r["layer"] == LAYER_FORWARDS[recompute]  # it did recompute
    assert calls_r["core_attention"] == 2  # layer 0's attention is recomputed by every method
    assert torch.equal(loss_r, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_r[name], grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["attention-fork", "block-fork"])
def test_recompute_replays_the_rng_tracker_streams(sequence_parallel):
    """Dropout forked into the tracker's model-parallel stream gets the same masks when recomputed
    (torch's checkpoint knows only the default generator)."""
    tracker = RNGStatesTracker("cpu")
    tracker.add(MODEL_PARALLEL, 0)
    full = RECOMPUTE["full-uniform-2"]
    loss, grads, _ = loss_and_grads(GPT, {}, rng_tracker=tracker, sequence_parallel=sequence_parallel)
    loss_r, grads_r, _ = loss_and_grads(GPT, full, rng_tracker=tracker, sequence_parallel=sequence_parallel)
    assert torch.equal(loss_r, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_r[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    # The tracker's stream really was used: without it the loss differs.
    loss_plain, _, _ = loss_and_grads(GPT, {})
    assert not torch.equal(loss_plain, loss)
