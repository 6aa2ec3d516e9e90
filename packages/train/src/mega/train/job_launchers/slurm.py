"""``mega launch slurm``: an sbatch script for a mega job, one task per GPU.

srun starts ``nodes x gpus_per_node`` tasks of ``mega train FLAGS``; each joins the job from
SLURM's own variables (mega.core.process_group: SLURM_PROCID is the rank, SLURM_NTASKS the world
size, SLURM_LOCALID the GPU, SLURM_NODEID the node), and meets its peers at the job's first node
(MASTER_ADDR). Every line that sets something is preceded by a comment that says why, so the script
can be read, and changed, before it is submitted.
"""

from __future__ import annotations

import dataclasses
import shlex

from mega.train.job_launchers.job import CUDA_SETTINGS, NETWORK_SETTINGS, Job


@dataclasses.dataclass(frozen=True)
class SlurmOptions:
    partition: str | None = None
    time: str | None = None  # SLURM's --time, e.g. 04:00:00
    account: str | None = None
    # The shared directories the tasks see at the same path (pyxis' --container-mounts), e.g. the
    # file system that holds --data-path and --save.
    container_mounts: tuple[str, ...] = ()


def sbatch_script(job: Job, options: SlurmOptions = SlurmOptions()) -> str:
    lines = [
        "#!/bin/bash",
        "# A mega training job, written by `mega launch slurm` (docs/multinode.md). Submit it with `sbatch`.",
        "# One task per GPU: each runs `mega train` and takes its rank, the world size, its GPU and its node",
        "# from SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_NODEID.",
        *_sbatch(job, options),
        "",
        "# Stop at the first failed command (not pipefail: head closing the pipe below is not a failure).",
        "set -eu",
        "",
        "# The job's first node: every rank meets its peers there (the process group's store).",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export MASTER_ADDR",
        "# A free port on that node (set MASTER_PORT before sbatch to use another).",
        f'export MASTER_PORT="${{MASTER_PORT:-{job.master_port}}}"',
        *(line for name, (value, why) in CUDA_SETTINGS.items() for line in (f"# {why}", f"export {name}={value}")),
        "",
        "# NCCL and InfiniBand, as commented defaults: NCCL finds the fast network itself; set these when a job",
        "# hangs at its start or its bandwidth is far below what nccl-tests or `mega bench comm` measure.",
        *(line for name, (value, why) in NETWORK_SETTINGS.items() for line in (f"# {why}", f"# export {name}={value}")),
        "",
        *_container_comment(job),
        "# --kill-on-bad-exit: one failed task ends the others (srun names it: task N, its node, its exit code).",
        " \\\n    ".join(_srun(job, options)),
        "",
    ]
    return "\n".join(lines)


def _sbatch(job: Job, options: SlurmOptions) -> list[str]:
    settings = [
        (f"--job-name={job.name}", "the job's name in squeue and in the log's name"),
        (f"--nodes={job.nodes}", "the machines"),
        (f"--ntasks-per-node={job.gpus_per_node}", "one task (one rank) per GPU"),
        (f"--gpus-per-node={job.gpus_per_node}", "the GPUs of each machine"),
        ("--exclusive", "whole machines: another job would share their NVLink and network"),
        ("--output=%x-%j.out", "the log: every task's output, %x the job's name, %j its id"),
    ]
    settings += [(f"--{flag}={value}", why) for flag, value, why in (
        ("partition", options.partition, "the partition (queue)"),
        ("time", options.time, "the time limit; pair it with --exit-duration-in-mins to save before it"),
        ("account", options.account, "the account the time is charged to"),
    ) if value]
    return [line for setting, why in settings for line in (f"# {why}", f"#SBATCH {setting}")]


def _container_comment(job: Job) -> list[str]:
    if job.image:
        return ["# The container (pyxis/enroot): an image built from mega's Dockerfile, which starts from NGC's",
                "# PyTorch image (`docker build -t mega .`, pushed to a registry the nodes reach)."]
    return ["# No container: `mega` must be on the nodes' PATH (activate the environment above this line), or",
            "# pass --container-image to run in an image built from mega's Dockerfile."]


def _srun(job: Job, options: SlurmOptions) -> list[str]:
    words = ["srun", "--kill-on-bad-exit=1", f"--nodes={job.nodes}", f"--ntasks-per-node={job.gpus_per_node}"]
    if job.image:
        words.append(f"--container-image={shlex.quote(job.image)}")
        if options.container_mounts:
            words.append(f"--container-mounts={shlex.quote(','.join(options.container_mounts))}")
    return [*words, shlex.join(["mega", "train", *job.train_argv])]
