"""Preemption (issue 36, item 2; issue 47, item 2 under --max-restarts), on the CPU (gloo): under
--exit-signal-handler a SIGTERM ends the job after a checkpoint of the current iteration, with exit
0; --load continues with the losses of the uninterrupted run; a second SIGTERM during that save
leaves the previous checkpoint loadable. --exit-duration-in-mins does the same when the time runs
out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from mega.core.checkpoint.directory import find_checkpoint, read_tracker
from mega.train.testing.training_runs import train_losses

ARGV = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--vocab-size", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--hidden-dropout", "0.1", "--train-iters", "8", "--lr", "1e-3", "--eval-iters", "0",
        "--log-interval", "1", "--seed", "7"]
# A rank whose checkpoint writes announce themselves and, when MEGA_TEST_SLOW_SAVE is set, take long
# enough for a second signal to arrive in the middle.
SLOW_SAVE = """
import os, sys, time
from mega.train.checkpoint import checkpointer
write = checkpointer.save_entries
def slow(*args, **kwargs):
    print('writing a checkpoint', flush=True)
    if os.environ.get('MEGA_TEST_SLOW_SAVE'):
        time.sleep(60)
    return write(*args, **kwargs)
checkpointer.save_entries = slow
from mega.core.cli.main import main
sys.argv = ['mega', *sys.argv[1:]]
sys.exit(main())
"""


def start(argv: list[str], **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SLOW_SAVE, "train", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


def losses_printed(lines: list[str]) -> dict[int, float]:
    return {int(line.split("/")[0].split()[-1]): float(line.split("lm loss: ")[1].split()[0])
            for line in lines if line.startswith(" iteration")}


def read_until(process: subprocess.Popen, text: str, seen: list[str]) -> None:
    for line in process.stdout:
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"the run ended before printing {text!r}: {''.join(seen)[-2000:]}")


def test_a_preempted_run_saves_exits_0_and_resumes_exactly(tmp_path):
    save = tmp_path / "ckpt"
    argv = ARGV + ["--save", str(save), "--exit-signal-handler"]
    first, seen = start(argv), []
    read_until(first, "iteration        2/", seen)
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=120)
    seen += out.splitlines(keepends=True)
    assert first.returncode == 0, err[-3000:]
    stopped = int(read_tracker(save))
    assert 2 <= stopped < 8
    assert f"mega train: exiting at iteration {stopped} of 8: received SIGTERM (--exit-signal-handler); " \
           f"checkpoint of iteration {stopped} saved in {save}" in out
    assert max(losses_printed(seen)) == stopped

    # The next job is preempted too, and its scheduler's second SIGTERM lands in the save.
    second, more = start(argv + ["--load", str(save)], MEGA_TEST_SLOW_SAVE="1"), []
    read_until(second, f"iteration {stopped + 1:8d}/", more)
    second.send_signal(signal.SIGTERM)
    read_until(second, "writing a checkpoint", more)
    second.send_signal(signal.SIGTERM)
    second.communicate(timeout=120)
    assert second.returncode == -signal.SIGTERM
    assert int(read_tracker(save)) == stopped
    assert find_checkpoint(str(save), checksums=True)[1].iteration == stopped  # whole, checksums and all

    full = train_losses(ARGV)
    resumed = train_losses(ARGV + ["--load", str(save)])
    assert resumed == full[stopped:]
    printed = losses_printed(seen + more)
    assert [printed[i + 1] for i in range(len(printed))] == [float(f"{loss:.6E}") for loss in full[:len(printed)]]


def test_the_time_limit_saves_and_exits_0(tmp_path, capsys):
    from mega.train.command import main

    save = tmp_path / "ckpt"
    # 0.0001 minutes (6 ms) is up after the first iteration
    assert main(ARGV + ["--save", str(save), "--exit-duration-in-mins", "0.0001"]) == 0
    assert read_tracker(save) == "1"
    assert "mega train: exiting at iteration 1 of 8: --exit-duration-in-mins 0.0001 reached; " \
           f"checkpoint of iteration 1 saved in {save}" in capsys.readouterr().out


def test_a_preempted_job_under_max_restarts_saves_and_exits_as_documented(tmp_path):
    """Issue 47, item 2: under mega's launcher with --max-restarts (torch's elastic agent, 2 ranks), a
    SIGTERM to the launcher is passed on, the ranks save the iteration and the job exits 0 with no
    traceback; a second SIGTERM during the save ends the ranks at once (143), the previous checkpoint
    staying the newest."""
    save = tmp_path / "ckpt"
    argv = [*ARGV, "--train-iters", "50", "--save", str(save), "--exit-signal-handler"]
    launcher = ("import sys; from mega.train.launch_job import launch_job; "
                f"sys.exit(launch_job(2, ['train', *sys.argv[1:]], 2, program=(sys.executable, '-c', {SLOW_SAVE!r})))")

    def start_job(*extra: str, **env) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", launcher, *argv, *extra], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env})

    first, seen = start_job(), []
    read_until(first, "iteration        2/", seen)
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert "mega: SIGTERM passed on to the ranks (--exit-signal-handler)" in err
    stopped = int(read_tracker(save))
    assert stopped >= 2 and max(losses_printed(seen + out.splitlines(keepends=True))) == stopped
    assert f"mega train: exiting at iteration {stopped} of 50: received SIGTERM (--exit-signal-handler); " \
           f"checkpoint of iteration {stopped} saved in {save}" in out

    second, more = start_job("--load", str(save), MEGA_TEST_SLOW_SAVE="1"), []
    read_until(second, f"iteration {stopped + 1:8d}/", more)
    second.send_signal(signal.SIGTERM)
    read_until(second, "writing a checkpoint", more)
    second.send_signal(signal.SIGTERM)
    _, err = second.communicate(timeout=300)
    assert second.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "was killed by SIGTERM after SIGTERM (--exit-signal-handler)" in err
    assert find_checkpoint(str(save), checksums=True)[1].iteration == stopped  # the previous one, whole


def test_ctrl_c_ends_a_run_with_one_line_and_130():
    run, seen = start(ARGV + ["--train-iters", "1000"]), []
    read_until(run, "iteration        2/", seen)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 128 + signal.SIGINT, err[-3000:]
    assert err.strip().splitlines()[-1] == "mega: interrupted by SIGINT" and "Traceback" not in err, err[-3000:]
