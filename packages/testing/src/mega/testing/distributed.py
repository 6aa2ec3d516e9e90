"""Run a function on N torch.distributed ranks (gloo on CPU) and collect what each returns.

A :class:`DistributedWorld` starts its processes once and then runs many functions. Ranks
fork from a forkserver that has already imported torch, the training stack and the plugins
(:mod:`mega.testing.rank_preload`), so starting a world takes a fraction of a second
instead of seconds of imports per rank. Functions are found by the
file they are defined in (test modules need not be importable by name), arguments and results
travel by pickle.

Failures never hang: a rank that raises fails the call with that rank's traceback; ranks that do
not answer within the timeout (a collective some rank never joined) fail it with a
:class:`WorldTimeout`. Either way the world is torn down and restarted for the next call.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

GRACE_AFTER_FAILURE_S = 3.0
# Every gloo process group a rank creates keeps threads that wake up about every 10 ms, idle or
# not; a world whose calls build many groups (megatron-core's initialize_model_parallel builds
# dozens each time) ends up with thousands of them, and they take the CPU from the calls that
# follow and from the module's other worlds. Past this many threads a world is restarted after
# the call that crossed it (each call is self-contained: its state is what it wrote to disk).
MAX_RANK_THREADS = 400


class RankFailed(AssertionError):
    """A rank raised; the message holds its traceback."""


class WorldTimeout(AssertionError):
    """Some ranks did not finish in time (usually a collective that not every rank joined)."""


def _function_reference(fn: Callable) -> tuple[str, str | None, str]:
    module = sys.modules.get(fn.__module__)
    path = getattr(module, "__file__", None)
    return fn.__module__, path, fn.__qualname__


def _load_function(reference: tuple[str, str | None, str], cache: dict) -> Callable:
    module_name, path, qualname = reference
    module = cache.get(module_name)
    if module is None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            # pytest's importlib mode gives test modules names that are not importable.
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        cache[module_name] = module
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _native_threads() -> int:
    """This process's thread count (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _worker(rank: int, world_size: int, init_file: str, backend: str, timeout_s: float, conn) -> None:
    # Start-up cost: torch is imported by the ranks (preloaded by their forkserver), not by every
    # test session that loads this fixture module.
    import torch
    import torch.distributed as dist

    # N ranks share few cores: one thread each avoids oversubscription, as torchrun does.
    torch.set_num_threads(1)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    modules: dict = {}
    while True:
        message = conn.recv_bytes()
        if not message:
            break
        reference, args, kwargs = pickle.loads(message)
        try:
            result = _load_function(reference, modules)(*args, **kwargs)
            reply = pickle.dumps(("ok", result, _native_threads()))
        except BaseException:
            reply = pickle.dumps(("error", traceback.format_exc(), _native_threads()))
        conn.send_bytes(reply)
    # No destroy_process_group and no interpreter shutdown: with many groups, gloo threads and
    # loaded models they take seconds per rank, and nothing is left to flush (results went back
    # through the pipe).
    sys.stdout.flush()
    sys.stderr.flush()
    conn.close()
    os._exit(0)


class DistributedWorld:
    """``world_size`` processes joined in one gloo process group, reused across calls."""

    def __init__(self, world_size: int, timeout_s: float = 120.0, backend: str = "gloo"):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.backend = backend
        self._processes: list = []
        self._connections: list = []
        self._tmpdir = None

    def _start(self) -> None:
        context = multiprocessing.get_context("forkserver")
        # Only takes effect when the forkserver starts (the first world of the session).
        context.set_forkserver_preload(["mega.testing.rank_preload"])
        self._tmpdir = tempfile.TemporaryDirectory(prefix="mega-world-")
        init_file = os.path.join(self._tmpdir.name, "rendezvous")
        for rank in range(self.world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=_worker,
                args=(rank, self.world_size, init_file, self.backend, self.timeout_s, child),
                daemon=True,
            )
            process.start()
            child.close()
            self._processes.append(process)
            self._connections.append(parent)

    def run(self, fn: Callable, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self._processes:
            self._start()
        message = pickle.dumps((_function_reference(fn), args, kwargs))
        for conn in self._connections:
            conn.send_bytes(message)

        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        crowded = False
        while len(results) + len(failures) < self.world_size and time.monotonic() < deadline:
            for rank, conn in enumerate(self._connections):
                if rank in results or rank in failures:
                    continue
                if not self._processes[rank].is_alive() and not conn.poll():
                    failures[rank] = f"rank {rank} died (exit code {self._processes[rank].exitcode})"
                elif conn.poll(0.01):
                    status, value, threads = pickle.loads(conn.recv_bytes())
                    (results if status == "ok" else failures)[rank] = value
                    crowded = crowded or threads > MAX_RANK_THREADS
            if failures:  # the other ranks may be stuck in a collective with the failed one
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)

        if failures or len(results) < self.world_size:
            self.close(force=True)
            name = getattr(fn, "__qualname__", repr(fn))
            if failures:
                rank = min(failures)
                raise RankFailed(f"{name} failed on rank {rank} of {self.world_size}:\n{failures[rank]}")
            missing = [rank for rank in range(self.world_size) if rank not in results]
            raise WorldTimeout(f"{name}: ranks {missing} of {self.world_size} did not finish in time")
        if crowded:
            self.close()  # the next call starts a fresh world
        return [results[rank] for rank in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if not force:
            for conn in self._connections:
                try:
                    conn.send_bytes(b"")  # asks the worker to leave its loop
                except (BrokenPipeError, OSError):
                    pass
        for process in self._processes:
            process.join(timeout=0 if force else 10)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._connections:
            conn.close()
        self._processes, self._connections = [], []
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> DistributedWorld:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class Worlds:
    """One :class:`DistributedWorld` per size, started on first use (a module's fixture)."""

    def __init__(self, timeout_s: float = 120.0):
        self.timeout_s = timeout_s
        self._worlds: dict[int, DistributedWorld] = {}

    def run(self, world_size: int, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        world = self._worlds.get(world_size)
        if world is None:
            world = self._worlds[world_size] = DistributedWorld(world_size, self.timeout_s)
        return world.run(fn, *args, **kwargs)

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()
