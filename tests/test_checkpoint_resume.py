"""A run stopped and resumed from its checkpoint computes what the uninterrupted run computes.

* Same layout (one process, and tp2 x pp2), with dropout on: the resumed losses are identical,
  bit for bit: weights, Adam moments, the iteration, the data position and every rank's RNG
  streams come back.
* Another layout: a checkpoint saved at tp2 x pp2 resumes at tp1 x pp1, tp1 x pp2, interleaved
  pp2 x vpp2 and dp2 with the distributed optimizer, and one saved by the distributed optimizer resumes in one process;
  the next losses match the uninterrupted tp2 x pp2 run to 1e-5 (dropout off: dropout masks
  depend on the layout).
  The vocabulary (90 tokens) pads to 128 rows at tp2 and 96 at tp1: the padding must not matter.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mega.train.testing.training_runs import assert_losses_close, train_losses

COMMON = [
    "--mock-data", "--model-family", "llama", "--model-preset", "tiny", "--num-layers", "4", "--hidden-size", "32",
    "--num-query-groups", "2", "--seq-length", "16", "--vocab-size", "90", "--make-vocab-size-divisible-by", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "12", "--lr", "1e-3",
    "--lr-warmup-iters", "2", "--eval-iters", "0", "--log-interval", "100", "--seed", "11",
]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
# The first run stops (and the reference saves) at STOP; the distributed optimizer saves again at LATER.
STOP, LATER = 6, 9
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def stop_and_resume(argv: list[str], save_dir: str, resume_argv: list[str] | None = None) -> tuple[list, list]:
    first = train_losses(argv + ["--exit-interval", str(STOP), "--save", save_dir])
    second = train_losses((resume_argv or argv) + ["--load", save_dir])
    return first, second


def four_ranks(save_dir: str) -> dict:
    """tp2 x pp2: uninterrupted and resumed with dropout; then, without dropout, the reference
    run whose iteration-STOP checkpoint the other layouts resume from."""
    base = COMMON + TP2_PP2
    results = {"full": train_losses(base + DROPOUT)}
    results["first"], results["resumed"] = stop_and_resume(base + DROPOUT, f"{save_dir}/dropout")
    results["reference"] = train_losses(base + NO_DROPOUT + ["--save", f"{save_dir}/tp2pp2", "--save-interval", str(STOP)])
    return results


def two_ranks(save_dir: str) -> dict:
    checkpoint = f"{save_dir}/tp2pp2/iter_{STOP:07d}"
    return {
        "tp1-pp2": train_losses(COMMON + NO_DROPOUT + ["--pipeline-model-parallel-size", "2", "--load", checkpoint]),
        "pp2-vpp2": train_losses(COMMON + NO_DROPOUT + ["--pipeline-model-parallel-size", "2",
                                                 "--num-layers-per-virtual-pipeline-stage", "1", "--load", checkpoint]),
        # The distributed optimizer takes the whole Adam moments as its dp slices, and saves them
        # as slices again at iteration LATER.
        "dp2-distributed-optimizer": train_losses(COMMON + NO_DROPOUT + [
            "--use-distributed-optimizer", "--load", checkpoint, "--save", f"{save_dir}/distopt",
            "--save-interval", str(LATER)]),
    }


# fp32 with --async-save (the synchronous save resumes exactly in the bf16/fp16 cases and at tp2 x pp2).
@pytest.mark.parametrize("precision,save_mode", [([], ["--async-save"]), (["--bf16"], []), (["--fp16"], [])],
                         ids=["fp32-async-save", "bf16", "fp16"])
def test_one_process_resume_is_exact(tmp_path, precision, save_mode):
    """bf16/fp16 also bring back the fp32 main weights; fp16 the dynamic loss scaler's state."""
    argv = COMMON + DROPOUT + precision
    full = train_losses(argv)
    first, second = stop_and_resume(argv + save_mode, str(tmp_path / "ckpt"), resume_argv=argv)
    assert first == full[:STOP]
    assert second == full[STOP:]


def test_resume_at_the_same_and_at_other_layouts(worlds, tmp_path):
    save_dir = str(tmp_path)
    four = worlds.run(4, four_ranks, save_dir)[0]
    assert four["first"] == four["full"][:STOP]
    assert four["resumed"] == four["full"][STOP:], "tp2 x pp2 resume must repeat the run exactly"

    reference_next = four["reference"][STOP:]
    two = worlds.run(2, two_ranks, save_dir)[0]
    assert_losses_close(two["tp1-pp2"], reference_next, "tp2 x pp2 -> tp1 x pp2")
    assert_losses_close(two["pp2-vpp2"], reference_next, "tp2 x pp2 -> pp2 x vpp2 (interleaved)")
    assert_losses_close(two["dp2-distributed-optimizer"], reference_next, "tp2 x pp2 -> dp2 distributed optimizer")

    one = train_losses(COMMON + NO_DROPOUT + ["--load", f"{save_dir}/tp2pp2/iter_{STOP:07d}"])
    assert_losses_close(one, reference_next, "tp2 x pp2 -> tp1 x pp1")
    from_sharded_optimizer = train_losses(COMMON + NO_DROPOUT + ["--load", f"{save_dir}/distopt/iter_{LATER:07d}"])
    assert Path(save_dir, "distopt", f"iter_{LATER:07d}").is_dir()
    assert_losses_close(from_sharded_optimizer, four["reference"][LATER:], "dp2 distributed optimizer -> tp1 x pp1")
