"""`mega train` at every parallel layout computes what one process computes.

GPT (learned positions, LayerNorm, GELU, tied embeddings) and LLaMA (RoPE, RMSNorm, SwiGLU, GQA,
untied) train 5 steps on Megatron's mock data, in fp32, from the same seed: one process, then
tp2, tp2 + sequence parallel, pp2, interleaved pp2 x vpp2, dp2, dp2 with the distributed
optimizer, tp2 with full recompute, and tp2 x pp2 x dp2 on 8 ranks. The losses must agree to
1e-5 (relative) at every step.

The vocabulary is padded to a multiple of make-vocab-size-divisible-by x tp, as in Megatron; the
settings below pad 90 tokens to 96 rows at tp 1 and to 128 at tp 2, and the padded rows must take
no part in the loss.
"""

from __future__ import annotations

import pytest

from mega.train.testing.training_runs import assert_losses_close, train_each, train_losses

COMMON = [
    "--mock-data", "--model-preset", "tiny", "--num-layers", "4", "--hidden-size", "32", "--seq-length", "16",
    "--vocab-size", "90", "--make-vocab-size-divisible-by", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "5",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "0", "--log-interval", "100",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7",
]
FAMILIES = {
    "gpt": ["--model-family", "gpt"],
    "llama": ["--model-family", "llama", "--num-query-groups", "2"],
}
TWO_RANK_LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "pp2-vpp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    "dp2": [],
    "dp2-distributed-optimizer": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
    "tp2-recompute": ["--tensor-model-parallel-size", "2", "--recompute-granularity", "full",
                      "--recompute-method", "uniform", "--recompute-num-layers", "1"],
}
EIGHT_RANK_LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                     "--sequence-parallel", "--use-distributed-optimizer"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_layout_matches_one_process(worlds, family):
    base = COMMON + FAMILIES[family]
    reference = train_losses(base)
    assert reference[-1] < reference[0], "the tiny model should learn the mock data"

    results = worlds.run(2, train_each, [base + extra for extra in TWO_RANK_LAYOUTS.values()])
    for index, layout in enumerate(TWO_RANK_LAYOUTS):
        # Every rank reports the same losses (they are shared from the last stage).
        assert results[0][index] == results[1][index], layout
        assert_losses_close(results[0][index], reference, layout)

    eight = worlds.run(8, train_losses, base + EIGHT_RANK_LAYOUT)
    assert all(losses == eight[0] for losses in eight)
    assert_losses_close(eight[0], reference, "tp2 x pp2 x dp2 (sequence parallel, distributed optimizer)")
