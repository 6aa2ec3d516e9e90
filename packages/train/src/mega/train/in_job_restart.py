"""``mega train --max-restarts N``: a job that restarts its ranks after a failure, on torchrun's agent.

The mechanism is torch.distributed.elastic's :class:`LocalElasticAgent` (what ``torchrun
--max-restarts`` runs): it starts the ranks, watches them, and when one dies (a crash, a SIGKILL, a
collective timeout's exit 3) stops every rank and starts them again, up to N times. mega adds
what a person reading the log needs:

* each restart is named with its cause (the rank that failed first and how) and the iterations
  it cost (the last iteration reached, from rank 0's progress file, minus the newest complete
  checkpoint in ``--save``); when the restarts are spent, every failure is listed;
* the ranks of a failed attempt are killed (SIGKILL), not asked to stop: a peer is gone, so there
  is nothing they could save (the newest complete checkpoint is what the next attempt loads);
* a restarted rank (``TORCHELASTIC_RESTART_COUNT`` > 0) with ``--save`` and no ``--load`` loads
  ``--save`` (:func:`resume_after_restart`), so the job resumes without any flag changing; with
  ``--load`` equal to ``--save`` it does anyway. This holds under ``torchrun --max-restarts`` too;
* a stop signal to the agent (a scheduler's preemption) is passed on to the ranks, as without
  restarts: the signal the ranks handle (``--exit-signal-handler``) lets them save and the job ends
  as they do (0 when every rank saved and exited), any other ends it with 128 + the signal; either
  way with one line, not the traceback of torch's ``SignalException``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from mega.core.checkpoint.directory import read_tracker
from mega.core.plugins import hookimpl
from mega.train.launch import describe_exit, free_port
from mega.train.nodes import Nodes

# Set for the ranks by the agent: rank 0 keeps the last iteration it finished here.
PROGRESS_FILE_ENV = "MEGA_PROGRESS_FILE"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
# The signals torch's agent turns into a SignalException (its default), to which the one the ranks
# handle is added: a --exit-signal SIGUSR1 must reach the ranks, not end the agent as SIGUSR1 does.
SIGNALS_TO_HANDLE_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# How long ranks saving on the handled signal may take before the agent kills them (torch's 30 s
# is short for a large checkpoint; the scheduler's own kill comes when it comes).
PREEMPTION_SAVE_GRACE_S = 600


# -- in the ranks ---------------------------------------------------------------------------------
def resume_after_restart(run):
    """A restarted rank resumes from --save (Megatron's convention: --load absent, --save holding
    the checkpoints); the first attempt, and a run with its own --load, are left as they are."""
    checkpoint = run.checkpoint
    if int(os.environ.get(RESTART_COUNT_ENV, "0")) > 0 and checkpoint.save and not checkpoint.load:
        return dataclasses.replace(run, checkpoint=dataclasses.replace(checkpoint, load=checkpoint.save))
    return run


class ProgressFile:
    """Rank 0 notes each finished iteration, so the agent can say how many a failure cost."""

    def __init__(self, path: str):
        self.path = Path(path)

    @hookimpl
    def on_step_end(self, run, iteration, metrics):
        if run.is_logging_rank:
            part = self.path.with_suffix(".part")
            part.write_text(str(iteration))
            os.replace(part, self.path)


def progress_file(run_config) -> ProgressFile | None:
    path = os.environ.get(PROGRESS_FILE_ENV)
    return ProgressFile(path) if path else None


# -- the agent ------------------------------------------------------------------------------------
def _newest_checkpoint(save: str | None) -> int | None:
    if not save:
        return None
    tracker = read_tracker(Path(save))
    return int(tracker) if tracker and tracker.isdigit() else None


def _read_progress(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def describe_failure(failures: dict, progress: int | None, node: int | None = None) -> str:
    """``rank 1 was killed by SIGKILL at iteration 5`` (the failure that came first); with ``node``
    (a multi-node job), ``rank 3 on node 1 ...``."""
    if not failures:
        return "a rank failed" if node is None else f"a rank on node {node} failed"
    # The agent SIGTERMs the other ranks as soon as one fails; they are listed too, so the failure
    # that came first is one that was not that SIGTERM, when there is one.
    own = {rank: failure for rank, failure in failures.items() if failure.exitcode != -signal.SIGTERM} or failures
    rank, failure = min(own.items(), key=lambda item: (item[1].timestamp, item[0]))
    text = f"rank {rank}{'' if node is None else f' on node {node}'} {describe_exit(failure.exitcode)}"
    if progress is not None:
        text += f" after iteration {progress}"
    return text


def _pass_on(signum: int, handlers) -> None:
    for handler in handlers:
        if handler.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it may have ended since
                os.killpg(handler.proc.pid, signum)  # each rank leads its own session, as torch starts it


def stopped_job_exit(signum: int, handled_signal: int | None, exit_codes: list[int | None]) -> int:
    """The exit code of a job whose agent received ``signum`` (its ranks were passed it and have
    ended with ``exit_codes``), with the line that says so."""
    name = signal.Signals(signum).name
    if signum != handled_signal or not exit_codes:  # not the ranks' signal, or no rank had started
        print(f"mega: stopped by {name}; the ranks were stopped too", file=sys.stderr, flush=True)
        return 128 + signum
    # The ranks saved (or failed to): the job ends as they did, as mega.train.launch.launch_local does.
    failed = [(rank, code) for rank, code in enumerate(exit_codes) if code]
    if not failed:
        return 0
    rank, code = failed[0]
    print(f"mega: rank {rank} {describe_exit(code)} after {name} (--exit-signal-handler)", file=sys.stderr, flush=True)
    return code if code > 0 else 128 - code


def run_with_restarts(nproc: int, command: list[str], max_restarts: int, save: str | None,
                      program: tuple[str, ...] = (sys.executable, "-m", "mega.core.cli.main"),
                      handled_signal: int | None = None, nodes: Nodes | None = None,
                      batch_at: Callable[[int], str] | None = None) -> int:
    """Run ``program + command`` on ``nproc`` local ranks under torch's elastic agent, restarting
    every rank after a failure at most ``max_restarts`` times; the job's exit code.

    ``nodes``: this node's part of a multi-node job (mega.train.nodes); without it, the job is
    these ``nproc`` ranks alone. With ``--nnodes MIN:MAX`` the job goes on after losing a node (a
    restart on the nodes left, from the newest checkpoint) and takes a joining node at its next
    restart; a change of size is said in one line, with ``batch_at(world_size)`` (the data-parallel
    size and gradient accumulation that keep the global batch).

    ``handled_signal``: the signal the ranks act on (``--exit-signal-handler``); sent to the agent,
    it is passed on and the job ends as its ranks do (see :func:`stopped_job_exit`)."""
    # Start-up cost: torch's elastic agent, which only a run with --max-restarts needs.
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.rendezvous import registry as rendezvous

    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    failures: list[str] = []

    with tempfile.TemporaryDirectory(prefix="mega-restarts-") as scratch:
        progress_path = Path(scratch) / "progress"
        os.environ[PROGRESS_FILE_ENV] = str(progress_path)  # the agent's ranks inherit it
        # Ranks share the cores, as torchrun arranges (and launch_local does).
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        handled_name = signal.Signals(handled_signal).name if handled_signal else None
        user_signals = os.environ.get(SIGNALS_TO_HANDLE_ENV)  # torch's knob: a user's setting stands
        if user_signals is None:
            os.environ[SIGNALS_TO_HANDLE_ENV] = ",".join(dict.fromkeys([*AGENT_SIGNALS, *filter(None, [handled_name])]))
        exit_codes: list[int | None] = []

        class ReportingAgent(LocalElasticAgent):
            def _monitor_workers(self, worker_group):
                result = super()._monitor_workers(worker_group)
                if result.is_failed():
                    progress = _read_progress(progress_path)
                    progress_path.unlink(missing_ok=True)  # the next attempt notes its own
                    # The node's number is the rendezvous's (GROUP_RANK, as its ranks see it), not --node-rank.
                    node = worker_group.group_rank if nodes.max_nodes > 1 else None
                    failures.append(describe_failure(result.failures, progress, node))
                    if self._remaining_restarts > 0:
                        self._say_restart(len(failures), progress)
                return result

            def _say_restart(self, number: int, progress: int | None) -> None:
                resumed = _newest_checkpoint(save)
                start = (f"iteration {resumed} (the newest checkpoint in {save})" if resumed else
                         "the start (no checkpoint in --save yet)" if save else "the start (no --save)")
                lost = (progress or 0) - (resumed or 0)
                print(f"mega: restart {number} of {max_restarts}: {failures[-1]}; every rank is restarted and "
                      f"resumes from {start}: {lost} iteration{'s' * (lost != 1)} lost",
                      file=sys.stderr, flush=True)

            def _rendezvous(self, worker_group):
                before = worker_group.group_world_size
                super()._rendezvous(worker_group)
                after = worker_group.group_world_size
                if before is not None and after != before:
                    world = after * worker_group.spec.local_world_size
                    line = f"mega: the job goes on with {after} node{'s' * (after != 1)} (was {before}): {world} rank{'s' * (world != 1)}"
                    print(line + (f", {batch_at(world)}" if batch_at else ""), file=sys.stderr, flush=True)

            def _stop_workers(self, worker_group):
                # A peer is gone: the others cannot save anything, so they are not asked to.
                self._shutdown(signal.SIGKILL)

            def _shutdown(self, death_sig=signal.SIGTERM, timeout=30):
                handlers = getattr(self._pcontext, "subprocess_handlers", {})
                running = any(handler.proc.poll() is None for handler in handlers.values())
                if death_sig == handled_signal and running:  # the ranks save, then exit
                    print(f"mega: {handled_name} passed on to the ranks (--exit-signal-handler)",
                          file=sys.stderr, flush=True)
                    timeout = max(timeout, PREEMPTION_SAVE_GRACE_S)
                    # A second one is passed on too, and ends the ranks at once (their handler is spent).
                    signal.signal(death_sig, lambda signum, frame: _pass_on(signum, handlers.values()))
                super()._shutdown(death_sig, timeout)
                exit_codes[:] = [handlers[rank].proc.returncode for rank in sorted(handlers)]

        # One node: a rendezvous of its own on a free local port.
        nodes = nodes or Nodes(1, 1, 0, "127.0.0.1", free_port())
        parameters = nodes.rendezvous_parameters()
        spec = WorkerSpec(role="mega", local_world_size=nproc, entrypoint=program[0],
                          args=(*program[1:], *command), rdzv_handler=rendezvous.get_rendezvous_handler(parameters),
                          max_restarts=max_restarts, monitor_interval=0.1)
        agent = ReportingAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=os.path.join(scratch, "logs")),
                               start_method="spawn")
        try:
            result = agent.run()
        except SignalException as stopped:  # the agent has passed it on and its ranks have ended
            return stopped_job_exit(stopped.sigval, handled_signal, exit_codes)
        finally:
            spec.rdzv_handler.shutdown()
            os.environ.pop(PROGRESS_FILE_ENV, None)
            if user_signals is None:
                os.environ.pop(SIGNALS_TO_HANDLE_ENV, None)
    if not result.is_failed():
        return 0
    if max_restarts == 0:
        print(f"mega: {failures[0] if failures else 'a rank failed'}; the job stops (--max-restarts 0)",
              file=sys.stderr, flush=True)
    else:
        listed = "; ".join(f"{number}) {failure}" for number, failure in enumerate(failures, 1))
        print(f"mega: the job failed {len(failures)} times, more than --max-restarts {max_restarts} allows: {listed}",
              file=sys.stderr, flush=True)
    own = [failure for failure in result.failures.values() if failure.exitcode != -signal.SIGTERM]
    first = min(own or result.failures.values(), key=lambda failure: failure.timestamp)
    return first.exitcode if first.exitcode > 0 else 128 - first.exitcode
