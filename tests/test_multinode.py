"""Multi-node `mega train` (issue 50, item 1), on the CPU
(gloo; the jobs pinned with CUDA_VISIBLE_DEVICES="", the reference run on a gloo rank):
two "nodes" on this machine, two `mega train --nnodes 2 --node-rank I --master-addr 127.0.0.1
--master-port P --nproc-per-node 2` processes meeting in torch's c10d rendezvous, train tp2 x dp2 on 4
ranks. The losses equal one process's (fp32, 1e-5), both nodes' ranks write one checkpoint into one
directory, each node names itself, and that checkpoint resumes on one node (2 ranks, tp2) with the
one-process losses of the iterations after it."""

from __future__ import annotations

import os
import subprocess
import sys

from mega.train.launch import free_port
from mega.train.testing.training_runs import assert_losses_close, logged_losses, train_losses

ARGV = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "4", "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "0", "--log-interval", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7"]
CPU = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def start_node(node_rank: int, port: int, argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mega.core.cli.main", "train", "--nnodes", "2", "--node-rank",
                             str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                             "--nproc-per-node", "2", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=CPU)


def test_two_nodes_train_tp2_dp2_like_one_process_and_resume_on_one_node(worlds, tmp_path):
    save = tmp_path / "shared-ckpt"
    argv = ARGV + ["--tensor-model-parallel-size", "2", "--save", str(save), "--save-interval", "2"]
    port = free_port()
    nodes = [start_node(rank, port, argv) for rank in (0, 1)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (_out, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-4000:]
    stderr = outputs[0][1] + outputs[1][1]
    # Each node's first rank says which node it is and which ranks it holds (the rendezvous numbers them).
    assert "mega: node 0 of 2 (" in stderr and "mega: node 1 of 2 (" in stderr
    assert "ranks 0-1 of 4" in stderr and "ranks 2-3 of 4" in stderr

    reference = worlds.run(1, train_losses, ARGV)[0]  # one process, on the CPU as the nodes are
    two_nodes = logged_losses(outputs[0][0] + outputs[1][0])
    assert sorted(two_nodes) == [1, 2, 3, 4]
    assert_losses_close([two_nodes[i] for i in (1, 2, 3, 4)], reference, "2 nodes, tp2 x dp2")

    # One directory holds each checkpoint, written by the ranks of both nodes, complete.
    assert sorted(path.name for path in save.iterdir() if path.name.startswith("iter_")) == [
        "iter_0000002", "iter_0000004"]
    resumed = worlds.run(2, train_losses, ARGV + ["--tensor-model-parallel-size", "2",
                                                  "--load", str(save / "iter_0000002")])[0]
    assert_losses_close(resumed, reference[2:], "resumed on one node from the 2-node checkpoint")


def test_a_node_without_the_rendezvous_address_is_told_what_to_pass():
    job = subprocess.run([sys.executable, "-m", "mega.core.cli.main", "train", "--nnodes", "2", "--node-rank", "1",
                          *ARGV], capture_output=True, text=True, timeout=120, env=CPU)
    assert job.returncode == 2
    assert "--nnodes above 1 needs --master-addr and --master-port" in job.stderr
