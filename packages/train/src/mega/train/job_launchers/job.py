"""What every engine's file needs to know of a job: its shape (nodes x GPUs), its image, and the
`mega train` flags each rank runs, checked before anything is written."""

from __future__ import annotations

import contextlib
import dataclasses
import io

from mega.core.config import ConfigError
from mega.core.plugins import PluginError

# The NGC PyTorch image our Dockerfile builds on; a job runs in an image built from that Dockerfile
# (NGC's own image has no mega in it).
NGC_BASE_IMAGE = "nvcr.io/nvidia/pytorch:25.01-py3"
# torchrun's default rendezvous port.
DEFAULT_MASTER_PORT = 29500
# Megatron's setting for overlapping tensor-parallel communication with compute (our Dockerfile sets it too).
CUDA_SETTINGS = {"CUDA_DEVICE_MAX_CONNECTIONS": ("1", "one hardware queue, so tensor-parallel communication "
                                                       "overlaps compute in the order it was issued (Megatron's setting)")}
# The NCCL and InfiniBand settings that matter on several nodes (docs/multinode.md), left to the user
# as commented defaults: NCCL finds the fast network itself, and a wrong value is worse than none.
NETWORK_SETTINGS = {
    "NCCL_SOCKET_IFNAME": ("ib0", "the high-speed network's interface for NCCL's bootstrap and socket traffic, "
                                  "not the management port (`ip addr` lists them); a wrong one hangs the start"),
    "GLOO_SOCKET_IFNAME": ("ib0", "the same for gloo (CPU-side groups)"),
    "NCCL_IB_HCA": ("mlx5", "the InfiniBand adapters NCCL may use (`ibstat` lists them)"),
    "NCCL_DEBUG": ("INFO", "NCCL's log: the transport each ring takes (NET/IB is InfiniBand, NET/Socket means "
                           "it fell back to TCP)"),
}


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    nodes: int
    gpus_per_node: int
    train_argv: tuple[str, ...]  # `mega train`'s flags, as every rank gets them
    image: str | None = None
    master_port: int = DEFAULT_MASTER_PORT

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def check_job(job: Job) -> None:
    """ValueError naming the problem: a shape that is not positive, no training flags, or flags that
    `mega train` would refuse at this world size (found now, not after the job has queued)."""
    if job.nodes < 1 or job.gpus_per_node < 1:
        raise ValueError(f"--nodes and --gpus-per-node must be >= 1, got {job.nodes} and {job.gpus_per_node}")
    if not job.train_argv:
        raise ValueError("no training flags: put `mega train`'s flags after `--` "
                         "(mega launch slurm --nodes 2 --gpus-per-node 8 -- --model-preset ...)")
    # Start-up cost: the run's configuration and model families, to check the flags.
    from mega.train.run_parser import LAUNCHER_FLAGS, parse_run

    taken = sorted(set(job.train_argv) & set(LAUNCHER_FLAGS))
    if taken:
        raise ValueError(f"{', '.join(taken)}: the engine starts the ranks; give only the run's flags after `--`")
    try:
        with contextlib.redirect_stderr(io.StringIO()) as said:
            run, _ = parse_run(list(job.train_argv))
        # The layout against the world size only: the rest (kernels, precision) depends on the GPUs
        # the job gets, which the machine writing the file may not have.
        run.parallel.data_parallel_size(job.world_size)
    except SystemExit:
        raise ValueError(f"the training flags do not parse: {said.getvalue().strip().splitlines()[0]}") from None
    except (ConfigError, PluginError, KeyError, ValueError) as error:
        raise ValueError(f"the training flags at {job.nodes} x {job.gpus_per_node} ranks: {error}") from None
