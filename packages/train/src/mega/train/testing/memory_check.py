"""What a training run really holds per rank, beside what ``mega plan`` says it holds: the check
of the planner (tests/test_plan_vs_training.py) and benchmarks/bench_fsdp_memory.py.

On every rank of a world, :func:`measured_and_planned` builds `mega train`'s Trainer, takes one
step (so the optimizer state exists), and measures:

* weights, gradients, optimizer state: the storages the Trainer holds (DDP's parameters and
  gradient buffers; under FSDP the local shards, gradients after a step's backward);
* activations: what one micro-batch's forward (and loss) saves for backward, through autograd's
  saved-tensor hooks (FSDP's gathered weights left out);
* gathered (FSDP): the largest sum, at any moment of a step's forward and backward (sampled at
  every tensor autograd saves or reads back), of the storages of the gathered parameters (a
  prefetched unit's flat all-gather buffer included) and of the unsharded gradients not yet
  reduce-scattered. A gradient autograd holds between two uses of one weight (a tied output
  layer's, until the embedding's) is not visible to the sampling.

FSDP's internals read here (FSDPParam, FSDPParamGroup) are torch 2.13's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from mega.core.parallel import ParallelGroups
from mega.core.parallel.local_shard import local
from mega.core.plugins import get_plugins
from mega.testing.saved_activations import saved_activation_bytes
from mega.train.command import parse_run
from mega.train.data_setup import build_datasets
from mega.train.planning.memory_plan import Layout, plan_memory
from mega.train.precision import grads_in_fp32
from mega.train.run_config import derive
from mega.train.trainer import Trainer


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def language_model_forward(stage, tokens: torch.Tensor, inputs: torch.Tensor, tp_group):
    """One micro-batch through a language-model stage: its output, or its loss on the last stage."""
    output = stage(inputs)
    return stage.loss(output, tokens, tp_group) if stage.post_process else output


def measured_and_planned(argv: list[str], forward=language_model_forward) -> dict:
    """On every rank: (measured, planned) bytes of weights, gradients, optimizer, activations;
    ``forward(stage, tokens, inputs, tp_group)`` runs one micro-batch through a chunk (a family
    whose stages take more than the hidden state passes its own)."""
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

        units = fsdp_units([stage]) if fsdp else []
        saved, _ = saved_activation_bytes(lambda stage=stage, inputs=inputs: forward(stage, tokens, inputs, groups.tp),
                                          exclude=[inputs, *map(local, stage.parameters())],
                                          weights=lambda units=units: gathered_weights(units))
        activations += saved
        layers = stage.decoder.layers  # keyed by global layer number
        planned_activations += family.memory_model(
            model, layers=len(layers), first_layer=min(map(int, layers), default=0), pre_process=stage.pre_process,
            post_process=stage.post_process, parallel=parallel, micro_batch_size=micro,
            dtype_bytes=trainer.dtype.itemsize, device_type="cpu").activation_bytes
    measured["activations"] = activations

    config = run.data_parallel
    layout = Layout(tp=parallel.tp, pp=parallel.pp, cp=parallel.cp, vpp=parallel.vpp or 1,
                    dp=derived.data_parallel_size, ep=parallel.ep, etp=parallel.etp,
                    sequence_parallel=parallel.sequence_parallel,
                    sharding=config.strategy(run.optimizer.use_distributed_optimizer), replicas=config.replicas,
                    recompute=model.recompute_granularity, micro_batch_size=micro)
    # FSDP reduces in fp32 unless told not to (MixedPrecisionPolicy), as mega plan assumes.
    fsdp_fp32 = fsdp and run.precision.accumulate_allreduce_grads_in_fp32 is not False
    grad_bytes = 4 if grads_in_fp32(run.precision) or fsdp_fp32 else trainer.dtype.itemsize
    rank = plan_memory(family, model, layout, dtype_bytes=trainer.dtype.itemsize, num_microbatches=derived.num_microbatches,
                       device_type="cpu", grad_dtype_bytes=grad_bytes)[groups.pp.rank]
    planned = {"weights": rank.weights, "gradients": rank.gradients, "optimizer": rank.optimizer,
               "activations": planned_activations}
    if fsdp:
        planned["gathered"] = rank.gathered
    return {"measured": measured, "planned": planned}


def fsdp_units(chunks) -> list:
    """FSDP's parameters (FSDPParam) of every unit of ``chunks``."""
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
