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

from mega.core.planning.memory_plan import Layout, plan_memory
from mega.core.testing.memory_check import ddp_held

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


def _saved_by_chunk(stage, tokens: torch.Tensor, hidden_size: int, seq: int, dtype, tp_group) -> int:
    """What one micro-batch's forward (and loss, on the last stage) through ``stage`` saves."""
    from mega.core.testing.saved_activations import saved_activation_bytes

    micro = tokens.shape[0]
    inputs = tokens if stage.pre_process else torch.randn(seq, micro, hidden_size, dtype=dtype, requires_grad=True)
    mtp = getattr(stage, "mtp", None) is not None

    def forward():
        output = stage({"tokens": tokens, "hidden": inputs} if mtp else inputs)
        if not stage.post_process:
            return output
        if not mtp:
            return stage.loss(output, tokens, tp_group)
        return [stage.loss(logits, tokens, tp_group) for logits in (output["logits"], *output["mtp_logits"])]

    saved, _ = saved_activation_bytes(forward, exclude=[inputs, *stage.parameters()])
    return saved


def measured_and_planned(argv: list[str]) -> dict:
    """On every rank: (measured, planned) bytes of weights, gradients, optimizer, activations."""
    import torch.distributed as dist

    from mega.core.parallel import ParallelGroups
    from mega.core.plugins import get_plugins
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
    measured = ddp_held(trainer)
    model, parallel, micro = run.model, run.parallel, run.training.micro_batch_size
    tokens = torch.randint(0, model.vocab_size, (micro, model.seq_length))
    seq = model.seq_length // (parallel.tp if parallel.sequence_parallel else 1)
    measured["activations"] = sum(_saved_by_chunk(chunk.module, tokens, model.hidden_size, seq, trainer.dtype, groups.tp)
                                  for chunk in trainer.chunks)
    layout = Layout(tp=parallel.tp, pp=parallel.pp, cp=parallel.cp, vpp=parallel.vpp or 1,
                    dp=derived.data_parallel_size, ep=parallel.ep, etp=parallel.etp,
                    sequence_parallel=parallel.sequence_parallel, recompute=model.recompute_granularity,
                    sharding="optim" if run.optimizer.use_distributed_optimizer else "no_shard", micro_batch_size=micro)
    grad_bytes = 4 if grads_in_fp32(run.precision) else trainer.dtype.itemsize
    rank = plan_memory(family, model, layout, dtype_bytes=trainer.dtype.itemsize, num_microbatches=derived.num_microbatches,
                       device_type="cpu", grad_dtype_bytes=grad_bytes)[groups.pp.rank]
    # One micro-batch's activations (the plan's peak holds the schedule's in flight).
    layers = len(trainer.chunks[0].module.decoder.layers)
    footprint = family.memory_model(model, layers=layers, first_layer=groups.pp.rank * layers,
                                    pre_process=groups.pp.rank == 0, post_process=groups.pp.rank == parallel.pp - 1,
                                    parallel=parallel, micro_batch_size=micro, dtype_bytes=trainer.dtype.itemsize,
                                    device_type="cpu")
    planned = {"weights": rank.weights, "gradients": rank.gradients, "optimizer": rank.optimizer,
               "activations": footprint.activation_bytes}
    return {"measured": measured, "planned": planned}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_plan_matches_what_training_allocates(worlds, layout):
    """CPU, 2 gloo ranks: the plan of a MoE family's layout within 2% (weights, gradients,
    optimizer) and 15% (one micro-batch's activations) of what one training step allocates."""
    for rank, result in enumerate(worlds.run(2, measured_and_planned, COMMON + LAYOUTS[layout])):
        measured, planned = result["measured"], result["planned"]
        for what, tolerance in (("weights", 0.02), ("gradients", 0.02), ("optimizer", 0.02), ("activations", 0.15)):
            error = abs(planned[what] - measured[what]) / measured[what]
            assert error <= tolerance, (f"{layout}, rank {rank}: planned {what} {planned[what]:,} bytes, "
                                        f"allocated {measured[what]:,} ({error:.1%} off)")
