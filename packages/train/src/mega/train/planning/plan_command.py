"""``mega plan``: what a run needs per GPU, before it is launched; ``--search`` for layouts that fit.

    mega plan --model-family llama --model-preset llama3-70b --world-size 64 \\
        --tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 --sequence-parallel \\
        --use-distributed-optimizer --recompute-activations --bf16 --global-batch-size 1024
    mega plan --model-preset 175b --fp16                  the seeds' 175B example (~2,800 GB)
    mega plan --model-family llama --model-preset llama2-13b --bf16 --gpus 8 --search
    mega plan --model-family llama --model-preset llama3-70b --bf16 --gpus 64 --use-torch-fsdp2

It takes `mega train`'s flags (the same parser) plus the machine: ``--world-size``/``--gpus``,
``--gpu-memory`` (GiB), ``--gpu`` (a name for the peak TFLOP/s) and ``--mfu``. Every
``--data-parallel-sharding-strategy`` is planned (FSDP's: mega.train.planning.fsdp_memory), and
refused with ``mega train``'s words where ``mega train`` would refuse it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from mega.core.cli.argparser import CommandParser
from mega.core.config import ConfigError
from mega.core.parallel.fsdp_config import STRATEGIES, check_sharding
from mega.core.pipeline.layout import layers_per_stage, layout_stage_count
from mega.core.pipeline.schedule_table import V_SCHEDULES
from mega.core.plugins import PluginError
from mega.train.device_peaks import peak_tflops_of
from mega.train.planning.memory_plan import Layout
from mega.train.planning.step_estimate import MEMORY_HEADROOM, estimate, search
from mega.train.precision import grads_in_fp32
from mega.train.run_config import model_with_megatron_shorthands
from mega.train.run_parser import parse_run

GIB = 1024**3
DEFAULT_MFU = 0.45  # about what mega reached for GPT 1.3B on one H100 (docs/benchmarks.md)


def _machine_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="mega plan", add_help=False,
        description="Memory per GPU (weights, gradients, optimizer state, activations, and FSDP's gathered "
                    "units) per pipeline stage, FLOPs and estimated step time of a `mega train` run, under its "
                    "--data-parallel-sharding-strategy (no_shard, optim, optim_grads, optim_grads_params or "
                    "--use-torch-fsdp2; HSDP with --num-distributed-optimizer-instances; --cpu-offload); "
                    "--search lists layouts that fit. Takes every `mega train` flag (see `mega train --help`) "
                    "plus these.")
    parser.add_argument("-h", "--help", action="store_true", help="show this help message and exit")
    parser.add_argument("--world-size", "--gpus", type=int, dest="world_size",
                        help="GPUs in the run (default: tp x pp x cp, one data-parallel replica)")
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default 80, an H100)")
    parser.add_argument("--gpu", default="H100", help="GPU name for its peak TFLOP/s (default H100); "
                        "--peak-tflops overrides it")
    parser.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                        help=f"model FLOPs utilisation to estimate the step time with (default {DEFAULT_MFU})")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="whose kernels' saved tensors to count (default cuda)")
    parser.add_argument("--search", action="store_true",
                        help="list the layouts (tp, pp, vpp, cp, dp, recompute, micro-batch, uneven pipeline "
                             "layouts) that fit, fastest first, each with the least data-parallel sharding that fits "
                             "(optim, then FSDP's optim_grads, then optim_grads_params; only the strategy named "
                             "with --data-parallel-sharding-strategy or --use-torch-fsdp2)")
    parser.add_argument("--top", type=int, default=15, help="layouts --search prints (default 15)")
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    return parser


def _gb(value: int) -> str:
    return f"{value / GIB:,.2f}"


def main(argv: list[str]) -> int:
    machine, train_argv = _machine_parser().parse_known_args(argv)
    if machine.help:
        _machine_parser().print_help()
        return 0
    try:
        run, family = parse_run(train_argv)
        return _plan(run, family, machine)
    except (ConfigError, PluginError, KeyError, ValueError) as error:
        print(f"mega plan: error: {error}", file=sys.stderr)
        return 2


def _plan(run, family, machine) -> int:
    model = model_with_megatron_shorthands(run)
    parallel = run.parallel
    world = machine.world_size or parallel.tp * parallel.pp * parallel.cp
    dtype_bytes = 2 if (run.precision.bf16 or run.precision.fp16) else 4
    peak = run.logging.peak_tflops or peak_tflops_of(machine.gpu, fp32=dtype_bytes == 4)
    budget = machine.gpu_memory * GIB
    grad_bytes = 4 if grads_in_fp32(run.precision) else dtype_bytes
    # FSDP reduces in fp32 unless told not to (the trainer's MixedPrecisionPolicy), fp16 included.
    fsdp_grad_bytes = dtype_bytes if run.precision.accumulate_allreduce_grads_in_fp32 is False else 4
    config = run.data_parallel
    fsdp_options = dict(replicas=config.replicas, reshard_after_forward=config.fsdp_reshard_after_forward,
                        cpu_offload=config.cpu_offload)
    common = dict(dtype_bytes=dtype_bytes, optimizer=run.optimizer.optimizer, peak_tflops=peak, mfu=machine.mfu,
                  device_type=machine.device)
    if machine.search:
        micro = run.training.micro_batch_size
        global_batch = run.training.global_batch_size or micro * world
        named = config.use_torch_fsdp2 or config.data_parallel_sharding_strategy is not None
        strategies = (config.strategy(False),) if named else STRATEGIES[1:]
        results = search(family, model, world_size=world, global_batch_size=global_batch, gpu_memory_bytes=budget,
                         grad_dtype_bytes=grad_bytes, fsdp_grad_dtype_bytes=fsdp_grad_bytes, strategies=strategies,
                         fsdp_options=fsdp_options, ep=parallel.ep, etp=parallel.etp, **common)
        return _print_search(results, machine, world, global_batch)

    parallel.validate(world)
    model.validate(parallel.tp)
    dp = world // (parallel.tp * parallel.pp * parallel.cp)
    run = check_sharding(run, dp, launching=False)  # what mega train refuses, in its words
    strategy = config.strategy(run.optimizer.use_distributed_optimizer)
    vpp = parallel.vpp or 1
    if run.training.num_layers_per_virtual_pipeline_stage:
        vpp = model.num_layers // parallel.pp // run.training.num_layers_per_virtual_pipeline_stage
    stages = layout_stage_count(run.pipeline)  # a layout string spells out pp * vpp stages
    vpp = stages // parallel.pp if stages else vpp
    schedule = run.pipeline.pipeline_schedule
    vpp = 2 if schedule in V_SCHEDULES else vpp  # two chunks per rank in a V
    counts = layers_per_stage(run.pipeline, model.num_layers, parallel.pp, vpp)
    fsdp = run.data_parallel.uses_fsdp(run.optimizer.use_distributed_optimizer)
    layout = Layout(tp=parallel.tp, pp=parallel.pp, cp=parallel.cp, vpp=vpp, dp=dp, ep=parallel.ep,
                    etp=parallel.etp, sequence_parallel=parallel.sequence_parallel, sharding=strategy,
                    recompute=model.recompute_granularity, micro_batch_size=run.training.micro_batch_size,
                    layers_per_stage=tuple(counts) if counts else None, schedule=schedule,
                    **(fsdp_options if fsdp else {}))
    global_batch = run.training.global_batch_size or layout.micro_batch_size * dp
    result = estimate(family, model, layout, global_batch_size=global_batch,
                      grad_dtype_bytes=fsdp_grad_bytes if fsdp else grad_bytes, **common)
    fits = result.peak_bytes <= budget * (1 - MEMORY_HEADROOM)
    if machine.json:
        print(json.dumps(_as_json(result, fits, machine, run.precision.dtype_name), indent=2))
        return 0
    print(f"mega plan: {family.name} {run.training.model_preset or ''} on {world} GPUs: {layout.describe()}, "
          f"{run.precision.dtype_name}, {run.optimizer.optimizer}, global batch {global_batch}")
    header = ("stage", "layers", "params/rank", "weights GiB", "grads GiB", "optimizer GiB",
              "activations GiB", "in flight") + (("gathered GiB",) if fsdp else ()) + ("total GiB",)
    rows = [header] + [(str(r.stage), str(r.layers), f"{r.parameters:,}", _gb(r.weights), _gb(r.gradients),
                        _gb(r.optimizer), _gb(r.activations), str(r.in_flight))
                       + ((_gb(r.gathered),) if fsdp else ()) + (_gb(r.total),) for r in result.ranks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
    if fsdp:
        print("weights, grads and optimizer: this rank's FSDP shard (fp32); gathered: the units FSDP gathers and "
              "the gradients not yet reduce-scattered, at the peak")
    if layout.cpu_offload:
        print(f"--cpu-offload: {_gb(max(r.host for r in result.ranks))} GiB of sharded weights, gradients and "
              "optimizer state per rank in host memory")
    print(f"FLOPs per step: {result.flops_per_step:.3e}; pipeline bubble {result.bubble:.1%}")
    if result.step_time_s:
        print(f"at {machine.mfu:.0%} MFU of {peak:g} TFLOP/s per GPU: step {result.step_time_s:.3f} s, "
              f"{result.tokens_per_s:,.0f} tokens/s")
    verdict = "fits" if fits else "does NOT fit"
    print(f"{verdict} in {machine.gpu_memory:g} GiB per GPU: peak {_gb(result.peak_bytes)} GiB of "
          f"{_gb(budget * (1 - MEMORY_HEADROOM))} GiB usable ({MEMORY_HEADROOM:.0%} kept for CUDA, NCCL, fragmentation)")
    return 0


def _as_json(result, fits: bool | None, machine, dtype: str) -> dict:
    return {
        "layout": asdict(result.layout), "dtype": dtype, "world_size": result.layout.world_size,
        "ranks": [asdict(rank) | {"total": rank.total} for rank in result.ranks],
        "flops_per_step": result.flops_per_step, "bubble": result.bubble, "step_time_s": result.step_time_s,
        "tokens_per_s": result.tokens_per_s, "mfu": machine.mfu, "peak_bytes": result.peak_bytes,
        "gpu_memory_gib": machine.gpu_memory, "fits": fits,
    }


def _print_search(results, machine, world: int, global_batch: int) -> int:
    if machine.json:
        print(json.dumps([_as_json(r, True, machine, "") for r in results[:machine.top]], indent=2))
        return 0 if results else 1
    if not results:
        print(f"mega plan: no layout of {world} GPUs fits in {machine.gpu_memory:g} GiB per GPU "
              f"(global batch {global_batch}); more GPUs, a smaller micro-batch or model", file=sys.stderr)
        return 1
    print(f"mega plan --search: {len(results)} layouts of {world} GPUs fit in {machine.gpu_memory:g} GiB "
          f"(global batch {global_batch}); the {min(machine.top, len(results))} fastest:")
    for result in results[:machine.top]:
        speed = f"{result.tokens_per_s:>12,.0f} tokens/s" if result.tokens_per_s else ""
        print(f"  {result.layout.describe():<52} peak {_gb(result.peak_bytes):>7} GiB  {speed}")
    return 0
