"""`mega train` with uneven pipeline layouts and the zero-bubble schedules computes what one process
computes (fp32, gloo), for GPT, LLaMA and Mixtral, and a checkpoint resumes under another schedule.

One 4-rank world runs, 6 layers each:

* GPT, pp4, ``--pipeline-schedule zb-h1``, ``--decoder-first/last-pipeline-num-layers 1`` (1, 2, 2, 1),
  full recompute (the rerun layers defer their weight gradients as their forward did) and
  ``--compile`` (aot_eager; the linears of the compiled layers defer too);
* LLaMA, pp2 x dp2, ``zbv`` (two chunks per rank in a V) with a ``--pipeline-model-parallel-layout``
  string (1, 2, 1, 2 layers), saving at iteration 5; then tp2 x pp2 with sequence parallelism under
  interleaved zero bubble (``zb-h1``, 2 chunks per rank), the embedding and the loss each counted as
  a layer (1, 2, 2, 1), resumes from that checkpoint;
* Mixtral, pp2 x ep2 with the distributed optimizer, ``dualpipev`` with a layout whose last stage
  holds only the output layer and loss (1, 2, 3, 0);
* at pp4 with 8 virtual stages (the embedding and the loss alone on the first and the last): GPT
  under interleaved zero bubble, Mixtral under ``zbv``.

Losses must match the single-process run's to 1e-5 at every one of 10 steps.
"""

from __future__ import annotations

import pytest

from mega.core.config import ConfigError
from mega.train.run_config import derive
from mega.train.run_parser import parse_run
from mega.train.testing.training_runs import assert_losses_close, train_each, train_losses

COMMON = [
    "--mock-data", "--model-preset", "tiny", "--num-layers", "6", "--hidden-size", "32", "--seq-length", "16",
    "--vocab-size", "90", "--make-vocab-size-divisible-by", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "10", "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "0", "--log-interval", "100",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7",
]
FAMILIES = {
    "gpt": ["--model-family", "gpt"],
    "llama": ["--model-family", "llama", "--num-query-groups", "2"],
    "mixtral": ["--model-family", "mixtral", "--num-experts", "4", "--moe-router-topk", "2"],
}
# Compiled too (aot_eager: dynamo's tracing without code generation): the linears defer from
# the compiled layers, also when full recompute reruns them in B.
PP4_ZB_H1_FIRST_LAST = ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "zb-h1",
                        "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1",
                        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
                        "--compile", "--compile-backend", "aot_eager"]
PP2_ZBV_LAYOUT = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                  "--pipeline-model-parallel-layout", "Et|tt|t|tt,L"]
TP2_PP2_INTERLEAVED_ZB = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size",
                          "2", "--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "zb-h1",
                          "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
# pp4 with two chunks per rank: 8 virtual stages, the embedding and the loss each alone on one.
EIGHT_STAGES = ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout", "E|t|t|t|t|t|t|L"]
PP2_EP2_DUALPIPEV = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                     "--use-distributed-optimizer", "--pipeline-schedule", "dualpipev",
                     "--pipeline-model-parallel-layout", "Et|tt|ttt|L"]


def test_uneven_layouts_and_zero_bubble_schedules_match_one_process(worlds, tmp_path):
    references = {family: train_losses(COMMON + extra) for family, extra in FAMILIES.items()}
    saved = str(tmp_path / "zbv")
    runs = [
        COMMON + FAMILIES["gpt"] + PP4_ZB_H1_FIRST_LAST,
        COMMON + FAMILIES["llama"] + PP2_ZBV_LAYOUT + ["--save", saved, "--save-interval", "5"],
        COMMON + FAMILIES["llama"] + TP2_PP2_INTERLEAVED_ZB + ["--load", f"{saved}/iter_0000005"],
        COMMON + FAMILIES["mixtral"] + PP2_EP2_DUALPIPEV,
        COMMON + FAMILIES["gpt"] + EIGHT_STAGES + ["--pipeline-schedule", "zb-h1"],
        COMMON + FAMILIES["mixtral"] + EIGHT_STAGES + ["--pipeline-schedule", "zbv"],
    ]
    results = worlds.run(4, train_each, runs)
    assert all(result == results[0] for result in results)  # every rank reports the last stage's losses
    gpt, llama, resumed, mixtral, gpt_interleaved, mixtral_zbv = results[0]
    assert_losses_close(gpt_interleaved, references["gpt"], "gpt pp4 x 2 chunks, interleaved zero bubble")
    assert_losses_close(mixtral_zbv, references["mixtral"], "mixtral pp4 zbv")
    assert_losses_close(gpt, references["gpt"], "gpt pp4 zb-h1 compiled, 1 layer on the first and the last stage")
    assert_losses_close(llama, references["llama"], "llama pp2 zbv with a layout string")
    assert_losses_close(resumed, references["llama"][5:], "llama tp2 x pp2 interleaved zero bubble, resumed from zbv")
    assert_losses_close(mixtral, references["mixtral"], "mixtral pp2 x ep2 dualpipev, distributed optimizer")


@pytest.mark.parametrize(("extra", "message"), [
    (["--model-family", "gpt", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"],
     "untie them \\(--untie-embeddings-and-output-weights\\)"),
    (["--model-family", "llama", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
      "--num-virtual-stages-per-pipeline-rank", "3"], "two model chunks per pipeline rank in a V; got 3"),
    (["--model-family", "llama", "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|t|t|t,L",
      "--num-virtual-stages-per-pipeline-rank", "3"], "4 stages = 2 per pipeline rank, but the virtual stages per rank are 3"),
    (["--model-family", "llama", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
      "--data-parallel-sharding-strategy", "optim_grads_params"], "--pipeline-schedule zb-h1 leaves .* but --data-parallel-sharding-strategy optim_grads_params \\(FSDP\\) "
     "reduces them at its end: use --pipeline-schedule 1f1b with FSDP"),
    (["--model-family", "llama", "--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "3",
      "--decoder-last-pipeline-num-layers", "2"], "the 1 layers left after .* do not split evenly over the 2 middle"),
])
def test_layouts_and_schedules_that_cannot_run_are_refused_before_training(extra, message):
    run, _ = parse_run(COMMON + extra)
    with pytest.raises(ConfigError, match=message):
        derive(run, world_size=4 if "4" in extra else 2)
