"""``mega launch slurm|k8s [options] -- TRAIN FLAGS``: write the engine's file for a job (and, for
SLURM, ``--submit`` it). The flags after ``--`` are `mega train`'s, checked here at the job's world
size so a mistake is found before the job queues."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from mega.core.cli.argparser import CommandParser
from mega.train.job_launchers.job import DEFAULT_MASTER_PORT, Job, check_job
from mega.train.job_launchers.kubernetes import PodOptions, check_save_on_the_volume, jobset, pytorchjob
from mega.train.job_launchers.slurm import SlurmOptions, sbatch_script


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher's options, `mega train`'s flags after ``--``)."""
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    return argv, []


def _job_parser(prog: str, description: str) -> CommandParser:
    parser = CommandParser(prog=prog, description=description,
                           usage=f"{prog} --nodes N --gpus-per-node G [options] -- TRAIN FLAGS",
                           epilog="The flags after `--` are `mega train`'s; see docs/multinode.md.")
    parser.add_argument("--nodes", type=int, required=True, help="the number of machines")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per machine, one rank each")
    parser.add_argument("--job-name", default="mega", help="the job's name (mega)")
    parser.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT,
                        help=f"the port on the first node where the ranks meet ({DEFAULT_MASTER_PORT})")
    return parser


def _job(args: argparse.Namespace, train_argv: list[str], image: str | None) -> Job:
    return Job(name=args.job_name, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
               train_argv=tuple(train_argv), image=image, master_port=args.master_port)


def slurm_main(argv: list[str] | None = None) -> int:
    own, train_argv = _split(sys.argv[1:] if argv is None else argv)
    parser = _job_parser("mega launch slurm", "Write an sbatch script that runs `mega train` on SLURM, "
                                              "one task per GPU (and submit it with --submit).")
    parser.add_argument("--partition", help="the partition to run in")
    parser.add_argument("--time", help="the time limit (SLURM's form, e.g. 04:00:00)")
    parser.add_argument("--account", help="the account to charge")
    parser.add_argument("--container-image", help="run in this image (pyxis/enroot): one built from mega's "
                                                  "Dockerfile; without it `mega` must be on the nodes' PATH")
    parser.add_argument("--container-mounts", default="", help="comma-separated SRC:DST the tasks see (the shared "
                                                               "file system of --data-path and --save)")
    parser.add_argument("-o", "--output", help="the script's path (JOB_NAME.sbatch)")
    parser.add_argument("--submit", action="store_true", help="run sbatch on the script once written")
    args = parser.parse_args(own)
    job = _job(args, train_argv, args.container_image)
    options = SlurmOptions(partition=args.partition, time=args.time, account=args.account,
                           container_mounts=tuple(filter(None, args.container_mounts.split(","))))
    try:
        check_job(job)
    except ValueError as error:
        print(f"mega launch slurm: error: {error}", file=sys.stderr)
        return 2
    path = Path(args.output or f"{job.name}.sbatch")
    _write(path, sbatch_script(job, options), executable=True)
    print(f"mega launch slurm: wrote {path} ({job.nodes} nodes x {job.gpus_per_node} GPUs)")
    if not args.submit:
        print(f"submit it with: sbatch {path}")
        return 0
    if shutil.which("sbatch") is None:
        print("mega launch slurm: error: --submit: sbatch is not on PATH (run this on a SLURM login node)",
              file=sys.stderr)
        return 2
    return subprocess.run(["sbatch", str(path)]).returncode


def _write(path: Path, text: str, executable: bool = False) -> None:
    """Whole or not at all: written beside, then renamed over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    if executable:
        part.chmod(0o755)
    part.replace(path)


def k8s_main(argv: list[str] | None = None) -> int:
    own, train_argv = _split(sys.argv[1:] if argv is None else argv)
    parser = _job_parser("mega launch k8s", "Write Kubernetes manifests that run `mega train`, one pod per node: "
                                            "a Kubeflow PyTorchJob and a JobSet (apply either with kubectl).")
    parser.add_argument("--image", required=True, help="the container image: one built from mega's Dockerfile")
    parser.add_argument("--checkpoint-claim", required=True,
                        help="a PersistentVolumeClaim (ReadWriteMany) every pod mounts; --save must be on it")
    parser.add_argument("--checkpoint-path", default="/checkpoints", help="where it is mounted (/checkpoints)")
    parser.add_argument("--namespace", help="the namespace to run in")
    parser.add_argument("--cpu", help="CPUs per pod (a Kubernetes quantity)")
    parser.add_argument("--memory", help="memory per pod (e.g. 1000Gi)")
    parser.add_argument("--shm-size", default="64Gi", help="/dev/shm per pod (64Gi)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for every rank (NCCL_SOCKET_IFNAME=..., see docs/multinode.md)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the whole job after a failure up to N times, resuming from --save (0)")
    parser.add_argument("--output-dir", default=".", help="where the two manifests go (.)")
    args = parser.parse_args(own)
    job = _job(args, train_argv, args.image)
    try:
        env = tuple(_name_value(setting) for setting in args.env)
        pod = PodOptions(checkpoint_claim=args.checkpoint_claim, checkpoint_path=args.checkpoint_path,
                         namespace=args.namespace, cpu=args.cpu, memory=args.memory, shm_size=args.shm_size,
                         env=env, max_restarts=args.max_restarts)
        if args.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
        check_job(job)
        check_save_on_the_volume(job, pod)
    except ValueError as error:
        print(f"mega launch k8s: error: {error}", file=sys.stderr)
        return 2
    for kind, manifest in (("pytorchjob", pytorchjob(job, pod)), ("jobset", jobset(job, pod))):
        path = Path(args.output_dir) / f"{job.name}-{kind}.json"
        _write(path, json.dumps(manifest, indent=2) + "\n")
        print(f"mega launch k8s: wrote {path} ({manifest['kind']}, {job.nodes} pods x {job.gpus_per_node} GPUs); "
              f"run it with: kubectl apply -f {path}")
    return 0


def _name_value(setting: str) -> tuple[str, str]:
    name, equals, value = setting.partition("=")
    if not equals or not name:
        raise ValueError(f"--env takes NAME=VALUE, got {setting!r}")
    return name, value
