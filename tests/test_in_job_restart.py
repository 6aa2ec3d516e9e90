"""`mega train --max-restarts` (issue 36, item 1), on torch's elastic agent, 2 ranks on the CPU:
rank 1 is SIGKILLed at iteration 6 of a run saving every 2 iterations; the job restarts every rank,
resumes from iteration 4 and exits 0, and its losses after the restart equal, bit for bit, those
of an uninterrupted run resumed from that checkpoint. A job that keeps failing ends after its
third failure, naming all three."""

from __future__ import annotations

import subprocess
import sys

from mega.train.testing.rank_programs import dying_rank
from mega.train.testing.training_runs import train_losses

ARGV = ["--mock-data", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--vocab-size", "64", "--micro-batch-size", "1", "--train-iters", "8",
        "--hidden-dropout", "0.1", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1", "--seed", "5"]
# Rank 1 of the first attempt is killed as iteration 6 starts; rank 0 notes each loss exactly.
RANK = dying_rank("os.environ['RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' "
                  "and self.state.iteration == 5")
# Rank 1 dies at once, every attempt; rank 0 waits for its peers.
DIES = "import os, signal, time; os.environ['RANK'] == '1' and os.kill(os.getpid(), signal.SIGKILL); time.sleep(60)"


def launcher(nproc: int, max_restarts: int, rank_program: str) -> str:
    return ("import sys; from mega.train.launch_job import launch_job; "
            f"sys.exit(launch_job({nproc}, ['train', *sys.argv[1:]], {max_restarts}, "
            f"program=(sys.executable, '-c', {rank_program!r})))")


def test_a_killed_rank_restarts_the_job_which_resumes_exactly(worlds, tmp_path):
    save, losses = tmp_path / "ckpt", tmp_path / "losses"
    job = subprocess.run([sys.executable, "-c", launcher(2, 2, RANK), *ARGV, "--save", str(save), "--save-interval", "2"],
                         capture_output=True, text=True, timeout=600, env={**__import__("os").environ,
                                                                            "MEGA_TEST_LOSSES": str(losses)})
    assert job.returncode == 0, job.stderr[-4000:]
    assert ("mega: restart 1 of 2: rank 1 was killed by SIGKILL after iteration 5; every rank is restarted and "
            f"resumes from iteration 4 (the newest checkpoint in {save}): 1 iteration lost") in job.stderr
    noted = [line.split() for line in losses.read_text().splitlines()]
    assert [int(it) for attempt, it, _ in noted if attempt == "0"] == [1, 2, 3, 4, 5]
    after_restart = {int(it): float(loss) for attempt, it, loss in noted if attempt == "1"}
    assert sorted(after_restart) == [5, 6, 7, 8]

    resumed = worlds.run(2, train_losses, ARGV + ["--load", str(save / "iter_0000004")])[0]
    assert [after_restart[i] for i in range(5, 9)] == resumed


def test_the_third_failure_ends_the_job_naming_all_three():
    job = subprocess.run([sys.executable, "-c", launcher(2, 2, DIES), *ARGV], capture_output=True, text=True, timeout=300)
    assert job.returncode == 137, job.stderr[-3000:]
    assert "mega: restart 1 of 2: rank 1 was killed by SIGKILL" in job.stderr
    assert "mega: restart 2 of 2: rank 1 was killed by SIGKILL" in job.stderr
    assert ("mega: the job failed 3 times, more than --max-restarts 2 allows: 1) rank 1 was killed by SIGKILL; "
            "2) rank 1 was killed by SIGKILL; 3) rank 1 was killed by SIGKILL") in job.stderr
