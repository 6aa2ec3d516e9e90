"""`mega launch slurm` (issue 50, item 3), on the CPU
(gloo; the jobs pinned with CUDA_VISIBLE_DEVICES="", the reference run on a gloo rank): the
sbatch script it writes passes `bash -n`, precedes every setting with the comment that names it, and,
run as sbatch would run it (SLURM_JOB_NODELIST, SLURM_NNODES) with stand-ins for `srun` (it starts
the tasks locally with SLURM_PROCID/NTASKS/LOCALID/NODEID) and `scontrol`, trains 2 nodes x 2 tasks
at tp2 x dp2 with the losses of one process (fp32, 1e-5). Flags that cannot run at the job's size are
refused before anything is written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from mega.train.job_launchers.command import slurm_main
from mega.train.launch import free_port
from mega.train.testing.training_runs import assert_losses_close, logged_losses, train_losses

ARGV = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "3", "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "0", "--log-interval", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7"]
# srun as the script calls it: its options, then the task's command, started once per task with the
# variables SLURM gives each; a failed task ends the others (--kill-on-bad-exit).
SRUN = """#!{python}
import os, subprocess, sys, time
args = sys.argv[1:]
options = {{}}
while args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    options[key] = value
nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
assert nodes == int(os.environ["SLURM_NNODES"]), "srun asks for the nodes sbatch allocated"
tasks = [subprocess.Popen(args, env=dict(os.environ, SLURM_PROCID=str(task), SLURM_NTASKS=str(nodes * per_node),
                                         SLURM_LOCALID=str(task % per_node), SLURM_NODEID=str(task // per_node)))
         for task in range(nodes * per_node)]
while any(task.poll() is None for task in tasks) and not any(task.poll() for task in tasks):
    time.sleep(0.1)
for task in tasks:
    task.poll() is None and task.kill()
sys.exit(max((task.wait() for task in tasks), key=abs))
"""
# `scontrol show hostnames LIST`: one host per line (the list here is already expanded).
SCONTROL = """#!/bin/bash
tr ',' '\\n' <<< "$3"
"""


def stand_ins(directory: Path) -> Path:
    directory.mkdir()
    for name, text in (("srun", SRUN.format(python=sys.executable)), ("scontrol", SCONTROL)):
        (directory / name).write_text(text)
        (directory / name).chmod(0o755)
    return directory


def test_the_sbatch_script_runs_two_nodes_like_one_process(worlds, tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    assert slurm_main(["--nodes", "2", "--gpus-per-node", "2", "--job-name", "tiny", "-o", str(script), "--",
                       *ARGV, "--tensor-model-parallel-size", "2"]) == 0
    assert f"wrote {script} (2 nodes x 2 GPUs)" in capsys.readouterr().out
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    lines = text.splitlines()
    settings = [i for i, line in enumerate(lines) if line.startswith(("#SBATCH", "export ", "# export "))
                or re.match(r"[A-Z_]+=", line)]
    for index in settings:  # each setting follows the comment that says what it does (or its own assignment)
        above, line = lines[index - 1], lines[index]
        assigned = line == f"export {above.split('=')[0]}"
        assert assigned or (above.startswith("# ") and index - 1 not in settings), f"no comment names {line!r}"
    for expected in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=2",
                     'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
                     "# export NCCL_SOCKET_IFNAME=", "# export NCCL_IB_HCA=mlx5", "# export NCCL_DEBUG=INFO"):
        assert expected in text

    bin_dir = stand_ins(tmp_path / "bin")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.1", "SLURM_NNODES": "2", "SLURM_JOB_ID": "1",
           "MASTER_PORT": str(free_port()), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    job = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert job.returncode == 0, job.stderr[-4000:]
    assert "mega: node 1 of 2 (" in job.stderr and "ranks 2-3 of 4" in job.stderr
    losses = logged_losses(job.stdout)
    assert sorted(losses) == [1, 2, 3]
    assert_losses_close([losses[i] for i in (1, 2, 3)], worlds.run(1, train_losses, ARGV)[0], "SLURM 2 nodes x 2 tasks, tp2 x dp2")


def test_the_container_line_names_the_image_and_the_shared_mounts(tmp_path):
    script = tmp_path / "job.sbatch"
    assert slurm_main(["--nodes", "4", "--gpus-per-node", "8", "--container-image", "registry.example/mega:1",
                       "--container-mounts", "/lustre:/lustre", "--partition", "gpu", "--time", "04:00:00",
                       "-o", str(script), "--", *ARGV, "--save", "/lustre/ckpt"]) == 0
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    for expected in ("--container-image=registry.example/mega:1", "--container-mounts=/lustre:/lustre",
                     "#SBATCH --partition=gpu", "#SBATCH --time=04:00:00", "--save /lustre/ckpt"):
        assert expected in text


def test_flags_that_cannot_run_at_the_jobs_size_are_refused_before_writing(tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    assert slurm_main(["--nodes", "1", "--gpus-per-node", "2", "-o", str(script), "--", *ARGV,
                       "--tensor-model-parallel-size", "4"]) == 2
    assert "the training flags at 1 x 2 ranks:" in capsys.readouterr().err
    assert not script.exists()
    assert slurm_main(["--nodes", "1", "--gpus-per-node", "2", "-o", str(script)]) == 2
    assert "no training flags" in capsys.readouterr().err
