"""A deadlock made on purpose (issue 36, item 4): rank 1 never joins iteration 3's loss all-reduce.
Rank 0's collective times out; every rank writes what it was doing to --save/debug/rank_R.txt;
the launcher compares the ranks' sequence numbers and names rank 1 as the one behind."""

from __future__ import annotations

import re
import subprocess
import sys

ARGV = ["--mock-data", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--vocab-size", "64", "--micro-batch-size", "2", "--train-iters", "5",
        "--eval-iters", "0", "--log-interval", "1", "--distributed-timeout-minutes", "0.1"]
# Rank 1 skips the loss all-reduce of iteration 3 and then waits forever elsewhere.
RANK = """
import os, sys, time
if os.environ['RANK'] == '1':
    from mega.train import trainer
    mean_over_ranks = trainer.Trainer._mean_over_ranks
    def skip_the_loss_all_reduce(self, losses, metrics):
        if self.state.iteration == 2:
            time.sleep(600)
        return mean_over_ranks(self, losses, metrics)
    trainer.Trainer._mean_over_ranks = skip_the_loss_all_reduce
from mega.core.cli.main import main
sys.argv = ['mega', *sys.argv[1:]]
sys.exit(main())
"""
LAUNCHER = ("import sys; from mega.train.launch_job import launch_job; "
            f"sys.exit(launch_job(2, ['train', *sys.argv[1:]], program=(sys.executable, '-c', {RANK!r})))")


def test_a_deadlock_is_reported_by_every_rank_and_the_rank_behind_is_named(tmp_path):
    save = tmp_path / "ckpt"
    job = subprocess.run([sys.executable, "-c", LAUNCHER, *ARGV, "--save", str(save)],
                         capture_output=True, text=True, timeout=240)
    assert job.returncode == 3, job.stderr[-3000:]
    assert "all_reduce did not complete within --distributed-timeout-minutes 0.1" in job.stderr
    waiting = re.search(r"in collective: #(\d+) +all_reduce +group (\S+) ranks \[0, 1\] sizes \[(\S*)\] "
                        r"float32 FAILED after", (save / "debug" / "rank_0.txt").read_text())
    assert waiting, (save / "debug" / "rank_0.txt").read_text()
    sequence, group = int(waiting.group(1)), waiting.group(2)
    rank_1 = (save / "debug" / "rank_1.txt").read_text()
    assert "in collective: none (between collectives)" in rank_1
    assert "skip_the_loss_all_reduce" in rank_1  # its main thread's stack shows where it is
    last = re.findall(rf"#(\d+) +(\w+) +group {group} ", rank_1)[-1]
    assert int(last[0]) == sequence - 1  # the all-reduce before, on that group
    assert (f"mega: rank 1 is behind: it entered {sequence - 1} collectives on group {group} (ranks [0, 1]), "
            f"while others wait in #{sequence} (all_reduce); reports in {save / 'debug'}") in job.stderr
