"""A run stopped and resumed continues as the uninterrupted run does, under every data-parallel
sharding strategy (issue 47: ZeRO-2/3 checkpoints lacked the optimizer state of the units an
evaluation had left gathered, and resuming failed).

Runs on the CPU: every layout is a world of gloo ranks (:mod:`mega.testing.distributed`),
one process included, so it computes the same on a GPU machine.

A tiny LLaMA (4 layers, fp32, Adam, no dropout) whose tensors do not divide evenly by the
data-parallel size: a 90-row vocabulary (no padding at tp1, 45 rows per tensor rank at tp2), an
FFN of 70 (35 rows per tensor rank), so FSDP's dim-0 shards and the distributed optimizer's flat
slices are uneven. Each layout trains STOP steps, evaluates (what left FSDP units gathered),
saves and exits; a second run loads that checkpoint and trains to ITERS. Every loss of both
equals the uninterrupted one-process run's within 1e-5 (relative), which every layout computes
(the numerics contract): a lost or zeroed Adam moment, a wrong step count or a piece of a tensor
left out changes the next steps far beyond that.

The layouts cover each strategy, each dp size, tp and pp, rather than their product:

================================  =====  ==========================================================
strategy                          world  why this combination
================================  =====  ==========================================================
FSDP2 (``--use-torch-fsdp2``)     1      FSDP over one rank: Megatron's flag spelling, whole shards
no_shard, tp2                     2      plain DDP with tensor-parallel pieces
optim (ZeRO-1), dp2               2      flat slices crossing parameter boundaries, uneven
optim_grads (ZeRO-2), dp2         2      the issue's case: no unit reshards after forward
optim (ZeRO-1), dp4               4      dp4 flat slices
optim_grads_params (ZeRO-3), dp4  4      the issue's case: the last layer stays gathered after eval
optim_grads, dp2 x tp2            4      FSDP shards of tensor-parallel shards
optim_grads_params, dp2 x pp2     4      under pp every layer stays gathered after forward
HSDP 2x2 (ZeRO-3)                 4      shards over 2 ranks, replicated over 2: replicas dedup
================================  =====  ==========================================================
"""

from __future__ import annotations

import pytest

from mega.train.testing.training_runs import assert_losses_close, train_losses

STOP, ITERS = 2, 4
COMMON = [
    "--mock-data", "--model-family", "llama", "--model-preset", "tiny", "--num-layers", "4", "--hidden-size", "36",
    "--num-attention-heads", "6", "--num-query-groups", "2", "--ffn-hidden-size", "70", "--seq-length", "16",
    "--max-position-embeddings", "16", "--vocab-size", "90", "--make-vocab-size-divisible-by", "1",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "1e-2",
    "--lr-warmup-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", str(STOP),
    "--eval-iters", "1", "--log-interval", "100", "--seed", "5",
]
STRATEGY = "--data-parallel-sharding-strategy"
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
LAYOUTS = {
    1: {"fsdp2 dp1": ["--use-torch-fsdp2"]},
    2: {
        "no_shard tp2": [STRATEGY, "no_shard", *TP2],
        "optim dp2": [STRATEGY, "optim"],
        "optim_grads dp2": [STRATEGY, "optim_grads"],
    },
    4: {
        "optim dp4": [STRATEGY, "optim"],
        "optim_grads_params dp4": [STRATEGY, "optim_grads_params"],
        "optim_grads dp2 x tp2": [STRATEGY, "optim_grads", *TP2],
        "optim_grads_params dp2 x pp2": [STRATEGY, "optim_grads_params", *PP2],
        "hsdp 2x2": [STRATEGY, "optim_grads_params", "--num-distributed-optimizer-instances", "2"],
    },
}


def stop_and_resume(layouts: dict[str, list[str]], save_dir: str) -> dict[str, tuple[list, list]]:
    """Per layout: the losses of the run that stops at STOP (saving), then of the resumed one."""
    results = {}
    for index, (name, flags) in enumerate(layouts.items()):
        directory = f"{save_dir}/{index}"
        first = train_losses(COMMON + flags + ["--exit-interval", str(STOP), "--save", directory])
        resumed = train_losses(COMMON + flags + ["--load", directory])
        results[name] = (first, resumed)
    return results


@pytest.fixture(scope="module")
def uninterrupted(worlds):
    return worlds.run(1, train_losses, COMMON)[0]


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_resume_continues_the_uninterrupted_run(worlds, tmp_path, uninterrupted, world):
    results = worlds.run(world, stop_and_resume, LAYOUTS[world], str(tmp_path))[0]
    for name, (first, resumed) in results.items():
        assert_losses_close(first, uninterrupted[:STOP], f"{name}: before the stop")
        assert_losses_close(resumed, uninterrupted[STOP:], f"{name}: resumed")
