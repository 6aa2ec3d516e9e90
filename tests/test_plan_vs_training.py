"""`mega plan`'s figures against what `mega train` really allocates and saves, on gloo ranks.

Weights, gradient buffers and optimizer state are summed over the storages a real Trainer holds
after one step (so Adam's moments exist); activations are the storages one micro-batch's forward
(and loss) saves for backward, counted by autograd's saved-tensor hooks. Attention dropout stays
off: on the CPU torch then falls back to a kernel keeping the [s, s] probabilities, which the
fused GPU kernels the plan describes do not.

Under FSDP (optim_grads, optim_grads_params) weights and gradients are the local shards, and
what FSDP gathers is measured too (mega.train.testing.memory_check says how). The peak the plan
states (the sum of all of them) must be within 10% of the measured sum.
"""

from __future__ import annotations

import pytest

from mega.train.testing.memory_check import measured_and_planned

MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "500", "--hidden-dropout", "0.1", "--attention-dropout", "0"]
LLAMA = ["--model-family", "llama", "--num-query-groups", "2", "--ffn-hidden-size", "160",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
COMMON = ["--mock-data", "--train-iters", "1", "--micro-batch-size", "2", "--log-interval", "1000",
          "--eval-iters", "0", "--lr", "1e-3"]

# Eight layouts of 4 ranks: tp, sp, pp, vpp, dp, the distributed optimizer, FSDP, recompute, dtypes.
LAYOUTS = {
    "gpt tp4 sp bf16": ["--tensor-model-parallel-size", "4", "--sequence-parallel", "--bf16"],
    "llama tp2 pp2 sp selective bf16": LLAMA + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                                 "2", "--sequence-parallel", "--recompute-activations", "--bf16",
                                                 "--global-batch-size", "4"],
    "gpt dp4 distributed optimizer bf16": ["--use-distributed-optimizer", "--bf16", "--global-batch-size", "16"],
    "llama pp2 dp2 distributed optimizer full recompute fp32": LLAMA + [
        "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "2", "--global-batch-size", "8"],
    "gpt tp2 pp2 vpp2 fp32": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "4"],
    "llama tp2 dp2 distributed optimizer block recompute bf16": LLAMA + [
        "--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16", "--recompute-granularity",
        "full", "--recompute-method", "block", "--recompute-num-layers", "3", "--global-batch-size", "8"],
    # FSDP: ZeRO-3 resharding after forward, one micro-batch a step; ZeRO-2 accumulating two. (An
    # untied output layer: a tied one's gradient waits inside autograd for the embedding's, where
    # the sampling cannot see it; the plan counts it.)
    "gpt dp4 optim_grads_params fp32": ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights",
                                        "--global-batch-size", "8"],
    "llama dp4 optim_grads bf16 two micro-batches": LLAMA + [
        "--data-parallel-sharding-strategy", "optim_grads", "--bf16", "--global-batch-size", "16"],
}
COMPONENTS = {"weights": 0.02, "gradients": 0.02, "optimizer": 0.02, "activations": 0.15, "gathered": 0.05}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plan_matches_what_training_allocates(worlds, layout):
    argv = MODEL + COMMON + LAYOUTS[layout]
    for rank, result in enumerate(worlds.run(4, measured_and_planned, argv)):
        measured, planned = result["measured"], result["planned"]
        for what in measured:
            error = abs(planned[what] - measured[what]) / measured[what]
            assert error <= COMPONENTS[what], (f"{layout}, rank {rank}: planned {what} {planned[what]:,} bytes, "
                                               f"allocated {measured[what]:,} ({error:.1%} off)")
        error = abs(sum(planned.values()) - sum(measured.values())) / sum(measured.values())
        assert error <= 0.10, (f"{layout}, rank {rank}: planned peak {sum(planned.values()):,} bytes, measured "
                               f"{sum(measured.values()):,} ({error:.1%} off)")
