"""Elastic membership (issue 50, item 2), on the CPU
(gloo; the jobs pinned with CUDA_VISIBLE_DEVICES="", the reference run on a gloo rank): two
nodes of a `--nnodes 1:2 --max-restarts 1` job (one rank each, dp2, global batch 4, a checkpoint
every 2 iterations); node 1 is lost at iteration 3 (its agent and its rank are SIGKILLed). Node 0's
agent restarts its rank alone from the checkpoint of iteration 2, says in one line that the job goes
on at 1 rank with gradient accumulation 4 for the same global batch, and exits 0; the losses after
the restart equal those of a one-process run resumed by hand from that checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys

from mega.train.launch import free_port
from mega.train.testing.rank_programs import dying_rank
from mega.train.testing.training_runs import assert_losses_close, train_losses

ARGV = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "6", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7"]
# The rank of node 1's first attempt takes its node down at iteration 3: its agent, then itself.
RANK = dying_rank("os.environ['GROUP_RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' "
                  "and self.state.iteration == 3", noted=("TORCHELASTIC_RESTART_COUNT", "WORLD_SIZE"), whole_node=True)
# `mega train --nnodes 1:2 --node-rank I ...` with the rank program above (the rendezvous notices a
# lost node after 2 missed 1 s heartbeats and waits 1 s for late nodes, not torchrun's 15 s and 30 s).
NODE = """
import sys
from mega.train.launch_job import launch_job
from mega.train.nodes import parse_nodes
node_rank, port, *argv = sys.argv[1:]
nodes = parse_nodes("1:2", int(node_rank), "127.0.0.1", int(port),
                    "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2")
sys.exit(launch_job(1, ["train", *argv], 1, program=(sys.executable, "-c", {rank!r}), nodes=nodes))
"""


def test_a_lost_node_leaves_the_job_running_on_the_rest_from_its_checkpoint(worlds, tmp_path):
    save, losses = tmp_path / "ckpt", tmp_path / "losses"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MEGA_TEST_LOSSES": str(losses)}
    port, argv = free_port(), [*ARGV, "--save", str(save), "--save-interval", "2"]
    nodes = [subprocess.Popen([sys.executable, "-c", NODE.format(rank=RANK), str(rank), str(port), *argv],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    (_, err), _ = [node.communicate(timeout=600) for node in nodes]
    assert nodes[1].returncode == -9
    assert nodes[0].returncode == 0, err[-4000:]
    assert ("mega: the job goes on with 1 node (was 2): 1 rank, data-parallel size 1, gradient accumulation 4 "
            "(global batch 4)") in err
    assert "resumes from iteration 2 (the newest checkpoint in" in err

    noted = [line.split() for line in losses.read_text().splitlines()]
    assert [(int(world), int(it)) for attempt, world, it, _ in noted if attempt == "0"] == [(2, 1), (2, 2), (2, 3)]
    after = {int(it): float(loss) for attempt, world, it, loss in noted if attempt == "1" and world == "1"}
    assert sorted(after) == [3, 4, 5, 6]
    by_hand = worlds.run(1, train_losses, [*ARGV, "--load", str(save / "iter_0000002")])[0]
    assert_losses_close([after[i] for i in (3, 4, 5, 6)], by_hand, "after the restart on 1 node")
