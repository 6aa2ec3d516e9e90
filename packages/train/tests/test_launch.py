"""The local launcher reports the rank that failed first (not the peers that broke after it) and how
it ended, passes stop signals on to its ranks and leaves no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mega.core.rank_exit import FAILURE_FILE_ENV, record_failure
from mega.train.launch import _first_recorded


def test_the_first_note_of_a_rank_wins(tmp_path, monkeypatch):
    path = tmp_path / "rank0.json"
    monkeypatch.setenv(FAILURE_FILE_ENV, str(path))
    record_failure(2)  # the clear error, noted where it was raised
    record_failure(1)  # the same process then exits non-zero
    assert json.loads(path.read_text())["exit_code"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.json"]


def test_the_earliest_failure_across_ranks_gives_the_exit_code(tmp_path):
    # Rank 1 stopped on bad input (2); rank 0's collective then broke (1), and may have exited first.
    (tmp_path / "rank0.json").write_text(json.dumps({"time": 1000.5, "exit_code": 1}))
    (tmp_path / "rank1.json").write_text(json.dumps({"time": 1000.2, "exit_code": 2}))
    paths = [str(tmp_path / f"rank{rank}.json") for rank in range(3)]  # rank 2 was stopped: no note
    assert _first_recorded(paths) == (1, 2)
    assert _first_recorded(paths[2:]) is None


def test_outside_the_launcher_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(FAILURE_FILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    record_failure(2)
    assert list(tmp_path.iterdir()) == []


# -- the launcher under faults (issue 15, items 1 and 5) ---------------------------------------
# The ranks here are small Python processes that say they are ready and wait: the launcher treats
# them exactly as it treats training ranks, without the seconds each rank would spend importing torch.
RANK = "import os, time; os.write(1, b'ready ' + os.environ['RANK'].encode() + b'\\n'); time.sleep(120)"
LAUNCHER = ("import sys; from mega.train import launch; launch.STOP_GRACE_S = 1.0; "
            f"sys.exit(launch.launch_local(2, [], program=(sys.executable, '-c', {RANK!r})))")


@pytest.fixture
def start_job():
    """Starts a 2-rank job and returns, once both ranks run, the launcher and its ranks' pids; kills
    whatever a failing test leaves running."""
    started = []

    def start() -> tuple[subprocess.Popen, list[int]]:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        started.append(launcher.pid)
        assert sorted(launcher.stdout.readline() for _ in range(2)) == ["ready 0\n", "ready 1\n"]
        started.extend(children_of(launcher.pid))
        return launcher, started[-2:]

    yield start
    for pid in still_running(started, within_s=0):
        os.kill(pid, signal.SIGKILL)


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    assert len(found) == 2, found
    return sorted(found)


def running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may never reap the orphans it inherits)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def still_running(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if running(pid)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_to_the_launcher_stops_every_rank(start_job, signum):
    launcher, ranks = start_job()
    launcher.send_signal(signum)
    assert launcher.wait(timeout=30) == 128 + signum  # was: exit at once, ranks orphaned and training
    assert still_running(ranks, within_s=0) == []
    assert f"mega: stopped by {signal.Signals(signum).name}" in launcher.stderr.read()


def test_ranks_die_with_a_killed_launcher(start_job):
    launcher, ranks = start_job()
    launcher.kill()
    launcher.wait()
    assert still_running(ranks, within_s=10) == [], "orphaned ranks kept running"


def test_a_rank_killed_by_a_signal_is_named(start_job):
    launcher, ranks = start_job()
    os.kill(ranks[1], signal.SIGKILL)
    assert launcher.wait(timeout=30) == 128 + signal.SIGKILL  # was: 1, naming nothing
    assert "mega: rank 1 was killed by SIGKILL, first; the other ranks were stopped" in launcher.stderr.read()
    assert still_running(ranks, within_s=0) == []


def test_a_rank_ends_without_interpreter_shutdown():
    # Interpreter shutdown after the process group is destroyed is where finished runs aborted
    # ("terminate called without an active exception", exit 250): a rank must never reach it.
    # An atexit handler shows whether shutdown ran; the exit code must survive either way.
    script = ("import atexit, sys; atexit.register(lambda: print('interpreter shut down', flush=True)); "
              "from mega.core.cli.main import main; sys.argv = ['mega', *sys.argv[1:]]; sys.exit(main())")
    rank = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    alone = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    for argv, code in ((["--version"], 0), (["no-such-command"], 2)):
        as_rank = subprocess.run([sys.executable, "-c", script, *argv], env=rank, capture_output=True, text=True)
        assert as_rank.returncode == code and "interpreter shut down" not in as_rank.stdout
        single = subprocess.run([sys.executable, "-c", script, *argv], env=alone, capture_output=True, text=True)
        assert single.returncode == code and "interpreter shut down" in single.stdout
    assert as_rank.stderr.startswith("mega: unknown command 'no-such-command'")  # flushed before the end


def test_a_stopped_rank_is_named_when_the_job_fails(start_job):
    # Its peers' collectives time out waiting for it; the launcher says which rank never came.
    launcher, ranks = start_job()
    os.kill(ranks[1], signal.SIGSTOP)
    os.kill(ranks[0], signal.SIGKILL)
    assert launcher.wait(timeout=60) == 128 + signal.SIGKILL
    error = launcher.stderr.read()
    assert f"mega: rank 1 (pid {ranks[1]}) is stopped (SIGSTOP or a debugger)" in error
    assert still_running(ranks, within_s=0) == []


def test_a_signal_the_ranks_handle_is_passed_on_and_the_job_ends_as_they_do():
    # --exit-signal-handler: the ranks save and exit 0 on SIGTERM; the launcher must not kill them.
    rank = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.5), sys.exit(0))); "
            "os.write(1, b'ready\\n'); time.sleep(120)")
    script = ("import signal, sys; from mega.train import launch; launch.STOP_GRACE_S = 0.5; sys.exit(launch.launch_local("
              f"2, [], program=(sys.executable, '-c', {rank!r}), handled_signal=signal.SIGTERM))")
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert [launcher.stdout.readline() for _ in range(2)] == ["ready\n", "ready\n"]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == 0  # the ranks took longer than the grace to finish, and were let
    assert "mega: SIGTERM passed on to the ranks (--exit-signal-handler)" in launcher.stderr.read()
