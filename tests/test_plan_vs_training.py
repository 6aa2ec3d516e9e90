"""`mega plan`'s figures against what `mega train` really allocates and saves, on gloo ranks.

Weights, gradient buffers and optimizer state are summed over the storages a real Trainer holds
after one step (so Adam's moments exist); activations are the storages one micro-batch's forward
(and loss) saves for backward, counted by autograd's saved-tensor hooks. Attention dropout stays
off: on the CPU torch then falls back to a kernel keeping the [s, s] probabilities, which the
fused GPU kernels the plan describes do not.
"""

from __future__ import annotations

import pytest
import torch

from mega.core.planning.memory_plan import Layout, plan_memory
from mega.core.plugins import get_plugins

MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "500", "--hidden-dropout", "0.1", "--attention-dropout", "0"]
LLAMA = ["--model-family", "llama", "--num-query-groups", "2", "--ffn-hidden-size", "160",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
COMMON = ["--mock-data", "--train-iters", "1", "--micro-batch-size", "2", "--log-interval", "1000",
          "--eval-iters", "0", "--lr", "1e-3"]

# Six layouts of 4 ranks: tp, sp, pp, vpp, dp, the distributed optimizer, recompute, dtypes.
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
}


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def measured_and_planned(argv: list[str]) -> dict:
    """On every rank: (measured, planned) bytes of weights, gradients, optimizer, activations."""
    import torch.distributed as dist

    from mega.core.parallel import ParallelGroups
    from mega.core.testing.saved_activations import saved_activation_bytes
    from mega.core.training.command import parse_run
    from mega.core.training.data_setup import build_datasets
    from mega.core.training.precision import grads_in_fp32
    from mega.core.training.run_config import derive
    from mega.core.training.trainer import Trainer

    plugins = get_plugins()
    run, family = parse_run(argv)
    run, derived = derive(run, dist.get_world_size())
    groups = ParallelGroups(run.parallel)
    run, data = build_datasets(run, derived, plugins)
    trainer = Trainer(run, derived, family, plugins, data, groups)
    trainer.train_step(trainer._microbatches(trainer.train_data, 0))

    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    buffers = [b for chunk in trainer.chunks for b in chunk.grad_buffers]
    measured = {
        "weights": _storage_bytes(params),
        "gradients": sum(b.grad_data.nbytes for b in buffers),
        "optimizer": trainer.optimizer.state_bytes(),
    }

    # One micro-batch through each of this rank's chunks, as the schedule would feed it.
    model, parallel, micro = run.model, run.parallel, run.training.micro_batch_size
    tokens = torch.randint(0, model.vocab_size, (micro, model.seq_length))
    seq = model.seq_length // (parallel.tp if parallel.sequence_parallel else 1)
    activations, planned_activations = 0, 0
    for chunk in trainer.chunks:
        stage = chunk.module
        inputs = tokens if stage.pre_process else torch.randn(seq, micro, model.hidden_size, dtype=trainer.dtype,
                                                              requires_grad=True)

        def forward(stage=stage, inputs=inputs):
            output = stage(inputs)
            return stage.loss(output, tokens, groups.tp) if stage.post_process else output

        saved, _ = saved_activation_bytes(forward, exclude=[inputs, *stage.parameters()])
        activations += saved
        planned_activations += family.memory_model(
            model, layers=len(stage.decoder.layers), pre_process=stage.pre_process,
            post_process=stage.post_process, parallel=parallel, micro_batch_size=micro,
            dtype_bytes=trainer.dtype.itemsize, device_type="cpu").activation_bytes
    measured["activations"] = activations

    layout = Layout(tp=parallel.tp, pp=parallel.pp, cp=parallel.cp, vpp=parallel.vpp or 1,
                    dp=derived.data_parallel_size, sequence_parallel=parallel.sequence_parallel,
                    distributed_optimizer=run.optimizer.use_distributed_optimizer,
                    recompute=model.recompute_granularity, micro_batch_size=micro)
    grad_bytes = 4 if grads_in_fp32(run.precision) else trainer.dtype.itemsize
    rank = plan_memory(family, model, layout, dtype_bytes=trainer.dtype.itemsize, num_microbatches=derived.num_microbatches,
                       device_type="cpu", grad_dtype_bytes=grad_bytes)[groups.pp.rank]
    planned = {"weights": rank.weights, "gradients": rank.gradients, "optimizer": rank.optimizer,
               "activations": planned_activations}
    return {"measured": measured, "planned": planned}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plan_matches_what_training_allocates(worlds, layout):
    argv = MODEL + COMMON + LAYOUTS[layout]
    for rank, result in enumerate(worlds.run(4, measured_and_planned, argv)):
        measured, planned = result["measured"], result["planned"]
        for what, tolerance in (("weights", 0.02), ("gradients", 0.02), ("optimizer", 0.02), ("activations", 0.15)):
            error = abs(planned[what] - measured[what]) / measured[what]
            assert error <= tolerance, (f"{layout}, rank {rank}: planned {what} {planned[what]:,} bytes, "
                                        f"allocated {measured[what]:,} ({error:.1%} off)")
