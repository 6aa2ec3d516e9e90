"""Starting and joining a distributed job: under torchrun/SLURM, or local processes we spawn.

``mega train --nproc-per-node N`` (and ``mega bench comm``) re-run the same command in N child
processes with torchrun's environment variables; each child then calls
:func:`init_distributed`, which reads that environment wherever it came from.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

# Each local rank may record its failure here, so the launcher can tell the rank that failed first
# (say, with a clear configuration error) from the peers whose collectives then broke.
FAILURE_FILE_ENV = "MEGA_FAILURE_FILE"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local(nproc: int, command: list[str], threads_per_process: int | None = None) -> int:
    """Run ``python -m mega.core.cli.main <command>`` on ``nproc`` local ranks; return the exit code.

    If a rank fails, the others are stopped, so a crash never leaves the job hanging.
    """
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be positive, got {nproc}")
    port = _free_port()
    threads = threads_per_process or max(1, (os.cpu_count() or 1) // nproc)
    with tempfile.TemporaryDirectory(prefix="mega-launch-") as failure_dir:
        failure_files = [os.path.join(failure_dir, f"rank{rank}.json") for rank in range(nproc)]
        processes = []
        for rank in range(nproc):
            env = dict(
                os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                OMP_NUM_THREADS=str(threads), **{FAILURE_FILE_ENV: failure_files[rank]},
            )
            processes.append(subprocess.Popen([sys.executable, "-m", "mega.core.cli.main", *command], env=env))
        exit_code = _supervise(processes)
        return _first_recorded_failure(failure_files) or exit_code


def _supervise(processes: list[subprocess.Popen]) -> int:
    """Wait for every process; stop them all at the first failure; return that failure's code."""
    exit_code = 0
    try:
        while any(p.poll() is None for p in processes):
            failed = [p for p in processes if p.poll() not in (None, 0)]
            if failed:
                exit_code = failed[0].returncode
                break
            time.sleep(0.05)
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
    return exit_code or next((p.returncode for p in processes if p.returncode), 0)


def record_failure(exit_code: int) -> None:
    """Note, for :func:`launch_local`, that this rank is failing now (the first note wins)."""
    path = os.environ.get(FAILURE_FILE_ENV)
    if not path or os.path.exists(path):
        return
    with open(path + ".part", "w") as out:
        json.dump({"time": time.time(), "exit_code": exit_code}, out)
    os.replace(path + ".part", path)


def _first_recorded_failure(paths: list[str]) -> int:
    """The exit code of the rank that recorded its failure first; 0 if none did."""
    records = []
    for path in paths:
        try:
            with open(path) as record:
                records.append(json.load(record))
        except (OSError, ValueError):
            continue
    return min(records, key=lambda r: r["time"])["exit_code"] if records else 0


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
    import torch
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
    dist.init_process_group(
        backend, rank=env["rank"], world_size=env["world_size"], timeout=timedelta(seconds=timeout_s)
    )
    return True
