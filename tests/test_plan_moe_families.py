"""`mega plan`'s figures for the mixture-of-experts families (deepseek-v3 here; every MoE family one
process in packages/models/tests/test_memory_model.py) against what
`mega train` really allocates and saves, on 2 gloo ranks (CPU), as tests/test_plan_vs_training.py
checks GPT and LLaMA, with its tolerances.

Weights, gradient buffers and optimizer state are the storages a real Trainer holds after one
step; activations are what one micro-batch's forward and loss save for backward (autograd's
saved-tensor hooks), through every chunk of the rank: DeepSeek-V3's last stage with its MTP
module (fed the tokens, its losses computed), its first stage with the dense first layer; the
tensor-parallel split with sequence parallelism; expert parallelism with the all-to-all dispatcher
and the distributed optimizer (dense state sharded over dp, the experts' over their own
data-parallel group: here a group of one).
"""

from __future__ import annotations

import pytest
import torch

from mega.train.testing.memory_check import language_model_forward, measured_and_planned

COMMON = ["--mock-data", "--train-iters", "1", "--micro-batch-size", "2", "--log-interval", "1000",
          "--eval-iters", "0", "--lr", "1e-3", "--model-preset", "tiny", "--seq-length", "32", "--vocab-size", "500"]
LAYOUTS = {
    "deepseek-v3 pp2 bf16 (MTP, first layer dense)": ["--model-family", "deepseek-v3", "--pipeline-model-parallel-size",
                                                      "2", "--global-batch-size", "4", "--bf16"],
    "deepseek-v3 tp2 sp fp32": ["--model-family", "deepseek-v3", "--tensor-model-parallel-size", "2",
                                "--sequence-parallel"],
    "deepseek-v3 ep2 alltoall distributed optimizer fp32": [
        "--model-family", "deepseek-v3", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
        "--global-batch-size", "4", "--use-distributed-optimizer"],
}


def _mtp_aware_forward(stage, tokens: torch.Tensor, inputs: torch.Tensor, tp_group):
    """One micro-batch through a DeepSeek-V3 stage: the last one's MTP modules take the tokens
    beside the hidden state, and each of their logits has a loss of its own."""
    if getattr(stage, "mtp", None) is None:
        return language_model_forward(stage, tokens, inputs, tp_group)
    output = stage({"tokens": tokens, "hidden": inputs})
    if not stage.post_process:
        return output
    return [stage.loss(logits, tokens, tp_group) for logits in (output["logits"], *output["mtp_logits"])]


def measured_and_planned_with_mtp(argv: list[str]) -> dict:
    return measured_and_planned(argv, forward=_mtp_aware_forward)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_plan_matches_what_training_allocates(worlds, layout):
    """CPU, 2 gloo ranks: the plan of a MoE family's layout within 2% (weights, gradients,
    optimizer) and 15% (one micro-batch's activations) of what one training step allocates."""
    for rank, result in enumerate(worlds.run(2, measured_and_planned_with_mtp, COMMON + LAYOUTS[layout])):
        measured, planned = result["measured"], result["planned"]
        for what, tolerance in (("weights", 0.02), ("gradients", 0.02), ("optimizer", 0.02), ("activations", 0.15)):
            error = abs(planned[what] - measured[what]) / measured[what]
            assert error <= tolerance, (f"{layout}, rank {rank}: planned {what} {planned[what]:,} bytes, "
                                        f"allocated {measured[what]:,} ({error:.1%} off)")
