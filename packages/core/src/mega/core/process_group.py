"""Joining the job's process group from the environment torchrun, SLURM or a local launcher set,
and the collective timeout every process group of the job then shares."""

from __future__ import annotations

import os
from datetime import timedelta


def distributed_env() -> dict[str, int] | None:
    """Rank, world size and local rank from torchrun's or SLURM's environment; None if neither."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return {
            "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"]),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        }
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return {
            "rank": int(os.environ["SLURM_PROCID"]),
            "world_size": int(os.environ["SLURM_NTASKS"]),
            "local_rank": int(os.environ.get("SLURM_LOCALID", 0)),
        }
    return None


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> bool:
    """Join the process group described by the environment; False when running as one process.

    The backend is NCCL when CUDA is present, gloo otherwise. Under SLURM, MASTER_ADDR and
    MASTER_PORT must be exported by the job script (as with torchrun on several nodes).
    """
    import torch  # start-up cost: the launcher process (`mega train --nproc-per-node`) never needs torch
    import torch.distributed as dist

    env = distributed_env()
    if env is None or dist.is_initialized():
        return dist.is_initialized()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(env["local_rank"])
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise RuntimeError(f"{name} is not set: export it (torchrun sets it; under SLURM the job script must)")
    global _collective_timeout
    _collective_timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, rank=env["rank"], world_size=env["world_size"], timeout=_collective_timeout,
                            store=_attempt_store(env["world_size"], _collective_timeout))
    return True


def _attempt_store(world_size: int, timeout: timedelta):
    """Under torch's elastic agent (torchrun, ``--max-restarts``), the agent's store, with the keys
    of this attempt under a prefix of their own; None elsewhere (torch makes the store).

    The agent keeps one store for every attempt of a job, so a restarted rank would read the
    addresses its failed predecessors wrote there (gloo then connects to ports nobody listens on)."""
    import torch.distributed as dist  # start-up cost: the launcher itself never needs torch

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"mega/attempt_{attempt}", store)


_collective_timeout: timedelta | None = None


def collective_timeout() -> timedelta | None:
    """The timeout the job was joined with, for the process groups created after it (torch's
    ``new_group`` does not inherit it: without it a sub-group's collective would wait torch's
    default of 30 minutes, not --distributed-timeout-minutes); None: torch's default."""
    return _collective_timeout
