"""`mega plan`'s figures against what `mega train` really allocates and saves, on gloo ranks.

Weights, gradient buffers and optimizer state are summed over the storages a real Trainer holds
after one step (so Adam's moments exist); activations are the storages one micro-batch's forward
(and loss) saves for backward, counted by autograd's saved-tensor hooks. Attention dropout stays
off: on the CPU torch then falls back to a kernel keeping the [s, s] probabilities, which the
fused GPU kernels the plan describes do not.

Under FSDP (optim_grads, optim_grads_params) weights and gradients are the local shards, and
what FSDP gathers is measured too: the largest sum, at any moment of a step's forward and backward
(sampled at every tensor autograd saves or reads back), of the storages of the gathered
parameters and of the unsharded gradients not yet reduce-scattered. The peak the plan states (the
sum of all five) must be within 10% of the measured sum.
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
    # FSDP: ZeRO-3 resharding after forward, one micro-batch a step; ZeRO-2 accumulating two. (An
    # untied output layer: a tied one's gradient waits inside autograd for the embedding's, where
    # the sampling cannot see it; the plan counts it.)
    "gpt dp4 optim_grads_params fp32": ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights",
                                        "--global-batch-size", "8"],
    "llama dp4 optim_grads bf16 two micro-batches": LLAMA + [
        "--data-parallel-sharding-strategy", "optim_grads", "--bf16", "--global-batch-size", "16"],
}
COMPONENTS = {"weights": 0.02, "gradients": 0.02, "optimizer": 0.02, "activations": 0.15, "gathered": 0.05}


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def measured_and_planned(argv: list[str]) -> dict:
    """On every rank: (measured, planned) bytes of weights, gradients, optimizer, activations."""
    import torch.distributed as dist

    from mega.core.parallel import ParallelGroups
    from mega.core.parallel.local_shard import local
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

    fsdp = run.data_parallel.uses_fsdp(run.optimizer.use_distributed_optimizer)
    measured = fsdp_held(trainer) if fsdp else ddp_held(trainer)

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

        units = fsdp_units([stage]) if fsdp else []
        saved, _ = saved_activation_bytes(forward, exclude=[inputs, *map(local, stage.parameters())],
                                          weights=lambda units=units: gathered_weights(units))
        activations += saved
        planned_activations += family.memory_model(
            model, layers=len(stage.decoder.layers), pre_process=stage.pre_process,
            post_process=stage.post_process, parallel=parallel, micro_batch_size=micro,
            dtype_bytes=trainer.dtype.itemsize, device_type="cpu").activation_bytes
    measured["activations"] = activations

    config = run.data_parallel
    layout = Layout(tp=parallel.tp, pp=parallel.pp, cp=parallel.cp, vpp=parallel.vpp or 1,
                    dp=derived.data_parallel_size, sequence_parallel=parallel.sequence_parallel,
                    sharding=config.strategy(run.optimizer.use_distributed_optimizer), replicas=config.replicas,
                    recompute=model.recompute_granularity, micro_batch_size=micro)
    grad_bytes = 4 if grads_in_fp32(run.precision) or fsdp else trainer.dtype.itemsize
    rank = plan_memory(family, model, layout, dtype_bytes=trainer.dtype.itemsize, num_microbatches=derived.num_microbatches,
                       device_type="cpu", grad_dtype_bytes=grad_bytes)[groups.pp.rank]
    planned = {"weights": rank.weights, "gradients": rank.gradients, "optimizer": rank.optimizer,
               "activations": planned_activations}
    if fsdp:
        planned["gathered"] = rank.gathered
    return {"measured": measured, "planned": planned}


def fsdp_units(chunks) -> list:
    """FSDP's parameters (FSDPParam) of every unit of ``chunks``."""
    from torch.distributed.fsdp import FSDPModule

    return [fsdp_param for chunk in chunks for module in chunk.modules() if isinstance(module, FSDPModule)
            for group in module._get_fsdp_state()._fsdp_param_groups for fsdp_param in group.fsdp_params]


def gathered_weights(units) -> list[torch.Tensor]:
    """The storages FSDP gathers the parameters of ``units`` into (empty between uses)."""
    return [tensor for unit in units for tensor in unit.all_gather_outputs]


def ddp_held(trainer) -> dict:
    """Bytes of parameters, DDP's gradient buffers and optimizer state after the step."""
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    buffers = [b for chunk in trainer.chunks for b in chunk.grad_buffers]
    return {"weights": _storage_bytes(params), "gradients": sum(b.grad_data.nbytes for b in buffers),
            "optimizer": trainer.optimizer.state_bytes()}


def fsdp_held(trainer) -> dict:
    """Bytes of FSDP's local shards (weights; gradients after a step's backward), optimizer state,
    and the most FSDP gathered at any moment of that forward and backward."""
    from torch.distributed.fsdp import FSDPModule

    from mega.core.parallel.local_shard import local

    groups = [group for chunk in trainer.chunks for module in chunk.modules() if isinstance(module, FSDPModule)
              for group in module._get_fsdp_state()._fsdp_param_groups]
    units = [fsdp_param for group in groups for fsdp_param in group.fsdp_params]
    peak = 0

    def sample(tensor):
        nonlocal peak
        # A prefetched unit's all-gather lands in one flat buffer, copied out when the unit runs.
        gathered = gathered_weights(units) + [group._all_gather_result.all_gather_output for group in groups
                                              if group._all_gather_result is not None]
        unsharded = [unit._unsharded_param for unit in units if hasattr(unit, "_unsharded_param")]
        unreduced = [param.grad for param in unsharded if param.grad is not None]
        unreduced += [unit.unsharded_accumulated_grad for unit in units if unit.unsharded_accumulated_grad is not None]
        peak = max(peak, _storage_bytes(gathered + unreduced))
        return tensor

    for chunk in trainer.chunks:
        chunk.zero_grad_buffer()
    with torch.autograd.graph.saved_tensors_hooks(sample, sample):
        trainer._run_schedule(trainer._microbatches(trainer.train_data, 0), forward_only=False)
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    return {"weights": _storage_bytes([local(p) for p in params]),
            "gradients": sum(local(p.grad).nbytes for p in params if p.grad is not None),
            "optimizer": trainer.optimizer.state_bytes(), "gathered": peak}


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
