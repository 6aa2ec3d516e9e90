"""Rewards: naming them on the command line, and scoring completions with them safely.

``--reward SPEC`` (repeatable) names one reward function and its weight::

    --reward math                 a registered reward (register_rewards hook), weight 1
    --reward math:2.0             the same, weight 2
    --reward my_pkg.rewards:brevity:0.5   a function by import path, weight 0.5

The text after the last colon is the weight when it reads as a number; what remains is an import
path when it holds a colon, else a registered name. A completion's reward is the weighted sum.

A reward function is called once per completion as ``fn(prompt=..., completion=..., **fields)``
(``fields``: the prompt line's other keys) and returns a float. A function with a ``completions``
parameter is TRL's batched kind: called once for the whole batch as ``fn(prompts=[...],
completions=[...], **{key: [value per completion]})``, returning one float per completion.

Calls run in worker processes, each with a time limit: a call that raises, runs past the limit or
returns something other than a finite number scores 0.0 and is counted (errors, timeouts,
non-finite), and the run goes on. A call past its limit has its worker killed and replaced, so a
reward that hangs (even inside C code) cannot stall the job. Functions must be importable by their
module and name (they travel to the workers by reference).
"""

from __future__ import annotations

import inspect
import math
import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from mega.core.plugins import get_plugins
from mega.core.plugins.registry import resolve


class RewardSpecError(ValueError):
    """A ``--reward`` that names no reward function or has a bad weight."""


@dataclass
class Reward:
    name: str                 # as the log names it: the spec without its weight
    function: Callable
    weight: float = 1.0
    batched: bool = False     # TRL's kind: completions=[...] in, a list out


def parse_reward_spec(spec: str) -> tuple[str, float]:
    """``"math:2"`` -> ``("math", 2.0)``; ``"pkg.mod:fn"`` -> ``("pkg.mod:fn", 1.0)``."""
    target, _, last = spec.rpartition(":")
    if target:
        try:
            weight = float(last)
        except ValueError:
            return spec, 1.0
        if not math.isfinite(weight):
            raise RewardSpecError(f"--reward {spec}: the weight must be a finite number, got {last}")
        return target, weight
    if not spec:
        raise RewardSpecError("--reward needs a name (e.g. math) or module:function")
    return spec, 1.0


def load_reward(spec: str, registry=None) -> Reward:
    """The reward ``spec`` names: an import path, or a name in ``registry`` (the plugins' rewards,
    ``mega.core.plugins.get_plugins().rewards`` when None)."""
    target, weight = parse_reward_spec(spec)
    if ":" in target:
        try:
            function = resolve(target)
        except (ImportError, AttributeError) as error:
            raise RewardSpecError(f"--reward {spec}: cannot import {target}: {error}") from None
    else:
        if registry is None:
            registry = get_plugins().rewards
        try:
            function = registry.get(target)
        except KeyError as error:  # UnknownNameError lists what is installed
            raise RewardSpecError(f"--reward {spec}: {error}") from None
    if not callable(function):
        raise RewardSpecError(f"--reward {spec}: {target} is not a function")
    try:
        batched = "completions" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        batched = False
    return Reward(target, function, weight, batched)


def load_rewards(specs: Sequence[str], registry=None) -> list[Reward]:
    """The rewards of every ``--reward``; one reward named twice is an error (give it one weight)."""
    rewards = [load_reward(spec, registry) for spec in specs]
    names = [reward.name for reward in rewards]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise RewardSpecError(f"--reward names {', '.join(twice)} more than once; give each reward once, "
                              "with its weight (NAME:WEIGHT)")
    if not rewards:
        raise RewardSpecError("no reward: give at least one --reward NAME[:WEIGHT] or module:function[:WEIGHT]")
    return rewards


@dataclass
class RewardCounts:
    """Per reward: calls made and those that scored 0 for a failure, with the first message."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    non_finite: int = 0
    first_error: str = ""


@dataclass
class Scores:
    total: list[float]                                    # the weighted sum, one per completion
    per_reward: dict[str, list[float]]                    # each reward's own values (0 where it failed)
    counts: dict[str, RewardCounts] = field(default_factory=dict)


def _worker(connection) -> None:
    """A worker process: call what arrives, send back ("ok", value) or ("error", message)."""
    connection.send("ready")  # started and imported: from here on a call's time is its own
    while True:
        try:
            job = connection.recv()
        except EOFError:
            return
        if job is None:
            return
        function, kwargs = job
        try:
            result = ("ok", function(**kwargs))
        except BaseException as error:  # the reward's failure is reported, never raised here
            result = ("error", f"{type(error).__name__}: {error}")
        try:
            connection.send(result)
        except Exception as error:  # an unpicklable return value
            connection.send(("error", f"its result cannot be sent back: {error}"))


STARTUP_TIMEOUT = 120.0  # seconds a fresh worker may take to start (spawn imports Python anew)


class _Worker:
    def __init__(self, context) -> None:
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.job: int | None = None
        self.started = time.monotonic()  # of the start-up, then of the job in hand

    def take_ready(self) -> None:
        """Read the worker's start-up message (it is waiting on the pipe)."""
        try:
            self.ready = self.connection.recv() == "ready"
        except (EOFError, OSError):
            self.ready = False
        if not self.ready:
            raise RuntimeError("a reward worker process died while starting")

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.connection.close()


class RewardPool:
    """``workers`` processes that score completions, each call limited to ``timeout`` seconds."""

    def __init__(self, workers: int = 4, timeout: float = 10.0, start_method: str = "spawn") -> None:
        if workers < 1:
            raise ValueError(f"reward workers must be >= 1, got {workers}")
        if not timeout > 0:
            raise ValueError(f"the reward timeout must be positive, got {timeout}")
        self.timeout = timeout
        self._context = multiprocessing.get_context(start_method)
        self._workers = [_Worker(self._context) for _ in range(workers)]
        for worker in self._workers:  # fail here, not in the first step, when workers cannot start
            if not worker.connection.poll(STARTUP_TIMEOUT):
                self.close()
                raise RuntimeError(f"reward worker processes did not start within {STARTUP_TIMEOUT:g} s")
            worker.take_ready()

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.connection.send(None)
            except OSError:
                pass
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.kill()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, jobs: Sequence[tuple[Callable, dict[str, Any]]]) -> list[tuple[str, Any]]:
        """Each job's ``("ok", value)``, ``("error", message)`` or ``("timeout", message)``, in order.
        A worker whose call runs past the limit is killed and a fresh one started in its place; the
        others go on with the remaining jobs meanwhile."""
        results: list[tuple[str, Any] | None] = [None] * len(jobs)
        pending = list(range(len(jobs)))[::-1]
        while pending or any(w.job is not None for w in self._workers):
            for worker in self._workers:
                if worker.ready and worker.job is None and pending:
                    worker.job, worker.started = pending.pop(), time.monotonic()
                    worker.connection.send(jobs[worker.job])
            busy = [w for w in self._workers if w.job is not None]
            starting = [w for w in self._workers if not w.ready]
            deadline = min([w.started + self.timeout for w in busy] + [w.started + STARTUP_TIMEOUT for w in starting])
            ready = wait([w.connection for w in busy + starting], timeout=max(0.0, deadline - time.monotonic()))
            for index, worker in enumerate(self._workers):
                if not worker.ready:
                    if worker.connection in ready:
                        worker.take_ready()
                    elif time.monotonic() - worker.started >= STARTUP_TIMEOUT:
                        raise RuntimeError(f"a reward worker process did not start within {STARTUP_TIMEOUT:g} s")
                elif worker.job is None:
                    continue
                elif worker.connection in ready:
                    try:
                        results[worker.job] = worker.connection.recv()
                    except (EOFError, OSError):  # the worker died (os._exit, a crash in C code)
                        results[worker.job] = ("error", "the reward's worker process died")
                        self._replace(index)
                        continue
                    worker.job = None
                elif time.monotonic() - worker.started >= self.timeout:
                    results[worker.job] = ("timeout", f"no result within {self.timeout:g} s")
                    self._replace(index)
        return results  # type: ignore[return-value]

    def _replace(self, index: int) -> None:
        self._workers[index].kill()
        self._workers[index] = _Worker(self._context)


def _as_score(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # a numpy or torch scalar
        except (TypeError, ValueError):
            return None
    value = float(value)
    return value if math.isfinite(value) else None


def score(rewards: Sequence[Reward], pool: RewardPool, prompts: Sequence[str], completions: Sequence[str],
          fields: Sequence[dict[str, Any]]) -> Scores:
    """Every reward of every completion (``fields[i]``: completion i's prompt-line fields)."""
    count = len(completions)
    if not (len(prompts) == len(fields) == count):
        raise ValueError(f"{len(prompts)} prompts, {count} completions and {len(fields)} field sets differ")
    jobs, owners = [], []  # owners: (reward index, completion indices the job scores)
    for which, reward in enumerate(rewards):
        if reward.batched:
            keys = sorted({key for f in fields for key in f})
            columns = {key: [f.get(key) for f in fields] for key in keys}
            jobs.append((reward.function, {**columns, "prompts": list(prompts), "completions": list(completions)}))
            owners.append((which, list(range(count))))
        else:
            for index in range(count):
                jobs.append((reward.function, {**fields[index], "prompt": prompts[index],
                                                "completion": completions[index]}))
                owners.append((which, [index]))
    outcomes = pool.run(jobs)

    per_reward = {reward.name: [0.0] * count for reward in rewards}
    counts = {reward.name: RewardCounts() for reward in rewards}
    for (which, indices), (status, value) in zip(owners, outcomes, strict=True):
        reward = rewards[which]
        tally = counts[reward.name]
        tally.calls += 1
        if status != "ok":
            if status == "timeout":
                tally.timeouts += 1
            else:
                tally.errors += 1
            tally.first_error = tally.first_error or str(value)
            continue
        values = value if reward.batched else [value]
        if reward.batched and (not isinstance(values, (list, tuple)) or len(values) != len(indices)):
            tally.errors += 1
            tally.first_error = tally.first_error or (
                f"returned {type(value).__name__} of length {len(value) if hasattr(value, '__len__') else '?'}, "
                f"expected a list of {len(indices)} numbers")
            continue
        for index, item in zip(indices, values, strict=True):
            number = _as_score(item)
            if number is None:
                tally.non_finite += 1
                tally.first_error = tally.first_error or f"returned {item!r}, not a finite number"
            else:
                per_reward[reward.name][index] = number
    total = [sum(reward.weight * per_reward[reward.name][index] for reward in rewards) for index in range(count)]
    return Scores(total, per_reward, counts)
