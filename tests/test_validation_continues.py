"""Each evaluation continues through the validation set where the previous one stopped (as in
Megatron: ``consumed_valid_samples``), and a resumed run continues from the saved position.

With one validation batch per evaluation at iterations 2 and 4, the evaluation at 4 must read the
second validation batch: its loss equals twice the two-batch mean minus the first batch's loss,
both taken from evaluations of the same iteration-4 model.
"""

from __future__ import annotations

import pytest

COMMON = [
    "--mock-data", "--model-family", "llama", "--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "32",
    "--num-query-groups", "2", "--seq-length", "16", "--vocab-size", "90", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3", "--log-interval", "100", "--seed", "3",
    "--split", "50,50,0",
]


def evaluations(argv: list[str], monkeypatch) -> tuple[list[float], int]:
    """The loss of every evaluation of a one-process run, and its consumed validation samples."""
    from mega.train.command import parse_run
    from mega.train.launch_run import run_training
    from mega.train.trainer import Trainer

    losses = []
    evaluate = Trainer.evaluate

    def recording(self):
        metrics = evaluate(self)
        losses.append(metrics["loss"])
        return metrics

    monkeypatch.setattr(Trainer, "evaluate", recording)
    state = run_training(*parse_run(argv))
    monkeypatch.undo()
    return losses, state.consumed_valid_samples


def test_evaluations_continue_through_the_validation_set_and_across_a_resume(tmp_path, monkeypatch):
    every_two, consumed = evaluations(COMMON + ["--eval-interval", "2", "--eval-iters", "1"], monkeypatch)
    assert consumed == 2 * 4
    (first_batch,), _ = evaluations(COMMON + ["--eval-interval", "4", "--eval-iters", "1"], monkeypatch)
    (two_batches,), _ = evaluations(COMMON + ["--eval-interval", "4", "--eval-iters", "2"], monkeypatch)
    second_batch = 2 * two_batches - first_batch
    assert abs(second_batch - first_batch) > 1e-4, "the two validation batches should differ"
    assert every_two[1] == pytest.approx(second_batch, rel=1e-5)

    save = str(tmp_path / "ckpt")
    stopped, _ = evaluations(COMMON + ["--eval-interval", "2", "--eval-iters", "1", "--exit-interval", "2",
                                       "--save", save], monkeypatch)
    resumed, consumed = evaluations(COMMON + ["--eval-interval", "2", "--eval-iters", "1", "--load", save], monkeypatch)
    assert stopped + resumed == every_two and consumed == 2 * 4
