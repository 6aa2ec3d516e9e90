"""`mega train --model-family t5` at every parallel layout computes what one process computes.

A tiny T5 (2 encoder + 2 decoder layers, relative-position buckets, tied head) trains 5 steps on
the t5-mock data in fp32 from one seed: one process, then tp2 with sequence parallelism, pp2 (the
encoder on one stage, the decoder on the other, by --pipeline-model-parallel-split-rank), dp2 with
the distributed optimizer, and on 4 ranks pp4 (one layer per stage: the encoder output carried
through both decoder stages). Losses agree to 1e-5 (relative) at every step. The same holds at
tp2 and pp2 for Megatron-LM's default T5 (learned absolute positions, LayerNorm, biases on every
linear layer; exact GELU, attention scaled, a tied output layer unscaled and with a bias: what
Megatron-LM T5 checkpoints hold). (The gated-GELU,
untied v1.1 variant is checked at tp2 against transformers in mega-models' tests.)
"""

from __future__ import annotations

from mega.train.testing.training_runs import assert_losses_close, train_each, train_losses

COMMON = [
    "--model-family", "t5", "--mock-data", "--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "32",
    "--num-attention-heads", "4", "--kv-channels", "8", "--ffn-hidden-size", "64", "--seq-length", "16",
    "--decoder-seq-length", "8", "--vocab-size", "90", "--make-vocab-size-divisible-by", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "5", "--lr", "1e-3",
    "--lr-warmup-iters", "1", "--eval-iters", "0", "--log-interval", "100", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--seed", "7",
]
TWO_RANK_LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2 split-rank 1": ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-split-rank", "1"],
    "dp2-distributed-optimizer": ["--use-distributed-optimizer"],
}
FOUR_RANK_LAYOUTS = {"pp4": ["--pipeline-model-parallel-size", "4"]}
MEGATRON_CORE_T5 = ["--feed-forward-proj", "gelu", "--softmax-scale", "0.35", "--no-scale-tied-output",
                    "--output-layer-bias", "--position-embedding-type", "learned_absolute", "--normalization",
                    "LayerNorm", "--add-bias-linear"]
MEGATRON_CORE_LAYOUTS = ("tp2-sp", "pp2 split-rank 1")


def test_every_t5_layout_matches_one_process(worlds):
    reference = train_losses(COMMON)
    assert reference[-1] < reference[0], "the tiny T5 should learn the mock data"

    megatron_core_reference = train_losses(COMMON + MEGATRON_CORE_T5)
    runs = [COMMON + extra for extra in TWO_RANK_LAYOUTS.values()]
    runs += [COMMON + MEGATRON_CORE_T5 + TWO_RANK_LAYOUTS[layout] for layout in MEGATRON_CORE_LAYOUTS]
    results = worlds.run(2, train_each, runs)
    for index, layout in enumerate([*TWO_RANK_LAYOUTS, *(f"megatron-core's T5, {name}" for name in MEGATRON_CORE_LAYOUTS)]):
        assert results[0][index] == results[1][index], layout
        expected = reference if index < len(TWO_RANK_LAYOUTS) else megatron_core_reference
        assert_losses_close(results[0][index], expected, layout)
    assert megatron_core_reference != reference

    four = worlds.run(4, train_each, [COMMON + extra for extra in FOUR_RANK_LAYOUTS.values()])
    for index, layout in enumerate(FOUR_RANK_LAYOUTS):
        assert all(losses[index] == four[0][index] for losses in four), layout
        assert_losses_close(four[0][index], reference, layout)
