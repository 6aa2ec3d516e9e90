"""`mega train` with context parallelism computes what one process computes.

GPT (learned positions, tied) and LLaMA (RoPE in every layer, GQA) train 5 steps in fp32 on
Megatron's mock data with 64-token sequences, from the same seed: one process, then on a 4-rank
gloo world cp4 with each --cp-comm-type (ring p2p, all_gather, a2a), and cp2 with each: p2p at
cp2 x dp2 and at cp2 x pp2 (LLaMA: the later stage's RoPE needs the chunks' positions too), a2a
at cp2 x dp2 with the distributed optimizer, all_gather at cp2 x tp2 with sequence parallelism;
for LLaMA also cp2 x pp2 interleaved with selective recompute. Every loss must agree with one process's to 1e-5 (relative). A checkpoint
written at cp2 resumes at cp4 and in one process and continues the one-process losses. Bad
input fails naming the flags.

Plain SGD without clipping: Adam (and clipping) would hide a gradient off by a constant factor,
such as a loss not summed right over the context ranks; SGD's steps follow the gradient's size.
"""

from __future__ import annotations

import pytest

from mega.train.testing.training_runs import assert_losses_close, train_losses

COMMON = [
    "--mock-data", "--model-preset", "tiny", "--num-layers", "4", "--hidden-size", "32", "--seq-length", "64",
    "--max-position-embeddings", "64", "--vocab-size", "90", "--make-vocab-size-divisible-by", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "5", "--optimizer", "sgd",
    "--clip-grad", "0", "--lr", "0.1",
    "--lr-warmup-iters", "1", "--eval-iters", "0", "--log-interval", "100", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--seed", "7",
]
FAMILIES = {
    "gpt": ["--model-family", "gpt"],
    "llama": ["--model-family", "llama", "--num-query-groups", "2"],
}
CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
LAYOUTS = {
    **{f"cp4-{comm}": CP4 + ["--cp-comm-type", comm] for comm in ("p2p", "all_gather", "a2a")},
    "cp2-dp2-p2p": CP2,
    "cp2-dp2-a2a-distributed-optimizer": CP2 + ["--cp-comm-type", "a2a", "--use-distributed-optimizer",
                                                "--overlap-grad-reduce"],
    "cp2-tp2-sp-all_gather": CP2 + ["--cp-comm-type", "all_gather", "--tensor-model-parallel-size", "2",
                                    "--sequence-parallel"],
    "cp2-pp2-p2p": CP2 + ["--pipeline-model-parallel-size", "2"],
}
INTERLEAVED = {"cp2-pp2-vpp2-recompute": CP2 + ["--pipeline-model-parallel-size", "2",
                                                "--num-layers-per-virtual-pipeline-stage", "1", "--recompute-activations"]}
SAVED_AT = 3


def four_ranks(layouts: dict, base: list[str], save_dir: str) -> dict:
    """Every layout; the cp2 x dp2 ring run saves at iteration 3, and cp4 resumes from it."""
    results = {}
    for name, extra in layouts.items():
        save = ["--save", save_dir, "--save-interval", str(SAVED_AT)] if name == "cp2-dp2-p2p" else []
        results[name] = train_losses(base + extra + save)
    results["cp2 -> cp4"] = train_losses(base + CP4 + ["--load", f"{save_dir}/iter_{SAVED_AT:07d}"])
    return results


@pytest.mark.parametrize("family", list(FAMILIES))
def test_context_parallel_layouts_match_one_process(worlds, tmp_path, family):
    base = COMMON + FAMILIES[family]
    reference = train_losses(base)
    assert reference[-1] < reference[0], "the tiny model should learn the mock data"

    layouts = LAYOUTS | (INTERLEAVED if family == "llama" else {})
    results = worlds.run(4, four_ranks, layouts, base, str(tmp_path))
    for layout in results[0]:
        assert all(rank[layout] == results[0][layout] for rank in results), f"{layout}: ranks disagree"
    for layout in layouts:
        assert_losses_close(results[0][layout], reference, layout)
    assert_losses_close(results[0]["cp2 -> cp4"], reference[SAVED_AT:], "saved at cp2, resumed at cp4")
    one = train_losses(base + ["--load", f"{tmp_path}/iter_{SAVED_AT:07d}"])
    assert_losses_close(one, reference[SAVED_AT:], "saved at cp2, resumed in one process")


def test_bad_context_parallel_input_names_the_flags():
    from mega.core.config import ConfigError
    from mega.core.parallel import ParallelConfig
    from mega.models.blocks.context_parallel import check_context_parallel
    from mega.models.config import ModelConfigError
    from mega.train.command import parse_run
    from mega.train.run_config import derive

    run, _ = parse_run(COMMON + FAMILIES["llama"] + CP4 + ["--seq-length", "36"])
    with pytest.raises(ConfigError, match=r"--seq-length 36 must be divisible by 2 x --context-parallel-size = 8"):
        derive(run, 4)

    run, _ = parse_run(COMMON + FAMILIES["gpt"] + ["--num-attention-heads", "2"])
    with pytest.raises(ModelConfigError, match=r"--cp-comm-type a2a .*heads per tensor-parallel rank \(2.*"
                                               r"--context-parallel-size 4"):
        check_context_parallel(run.model, ParallelConfig(cp=4, cp_comm_type="a2a"))
    check_context_parallel(run.model, ParallelConfig(cp=4, cp_comm_type="p2p"))  # the ring needs no head split
    run, _ = parse_run(COMMON + FAMILIES["gpt"] + ["--attention-dropout", "0.1"])
    with pytest.raises(ModelConfigError, match=r"--attention-dropout 0.1 with --context-parallel-size 2"):
        check_context_parallel(run.model, ParallelConfig(cp=2))
    with pytest.raises(SystemExit):  # argparse: an unknown comm type
        parse_run(COMMON + FAMILIES["gpt"] + ["--cp-comm-type", "ring"])
