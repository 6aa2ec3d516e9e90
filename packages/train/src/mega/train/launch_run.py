"""Run one training job in this process (one rank of it): the glue behind `mega train`."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch.distributed as dist

from mega.core.checkpoint import CheckpointError
from mega.core.checkpoint.directory import read_tracker
from mega.core.config import ConfigError
from mega.core.model_family import ModelFamily
from mega.core.parallel import ParallelGroups
from mega.core.plugins import PluginError, get_plugins
from mega.core.plugins.failures import TRACEBACKS_VARIABLE, tracebacks_wanted
from mega.core.process_group import distributed_env, init_distributed
from mega.core.rank_exit import record_failure
from mega.train.callback_errors import CALLBACK_EXIT_CODE, CallbackError
from mega.train.collective_timeout import describe_timeout
from mega.train.data_setup import build_datasets
from mega.train.hang_report import debug_dir, flight_recorder_env, write_report
from mega.train.in_job_restart import resume_after_restart
from mega.train.launch import TIMEOUT_EXIT_CODE
from mega.train.nodes import node_of_this_rank, where
from mega.train.run_config import RunConfig, derive
from mega.train.trainer import RunState, Trainer


def run_training(run: RunConfig, family: ModelFamily, plugins=None) -> RunState:
    """Train in this process (joining the distributed job its environment describes)."""
    plugins = plugins or get_plugins()
    run = resume_after_restart(run)
    flight_recorder_env(run.checkpoint.save)
    init_distributed(timeout_s=run.training.distributed_timeout_minutes * 60)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    announce_node()
    run, derived = derive(run, world_size)
    groups = ParallelGroups(run.parallel)
    run, data = build_datasets(run, derived, plugins)
    trainer = Trainer(run, derived, family, plugins, data, groups)
    return trainer.train()


def train(run: RunConfig, family: ModelFamily) -> int:
    """`mega train`'s exit code: 0, 2 with one clear line for a configuration problem, 4 when a
    plugin's callback raised (3 a collective timeout)."""
    try:
        run_training(run, family)
    except CallbackError as error:
        if describe_timeout(error.error, run.training.distributed_timeout_minutes) is not None:
            return _timed_out(error.error, run)  # a callback's collective: the peers' story, not the plugin's
        record_failure(CALLBACK_EXIT_CODE)
        print(f"mega train: error{_where()}: {callback_report(error, run.checkpoint.save)}", file=sys.stderr, flush=True)
        return CALLBACK_EXIT_CODE
    except (ConfigError, PluginError, CheckpointError, ValueError, FileNotFoundError) as error:
        # Recorded before the process group closes, so it precedes the peers' broken collectives.
        record_failure(2)
        print(f"mega train: error{_where()}: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        if describe_timeout(error, run.training.distributed_timeout_minutes) is None:
            raise
        return _timed_out(error, run)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _timed_out(error: RuntimeError, run: RunConfig) -> int:
    timeout = describe_timeout(error, run.training.distributed_timeout_minutes)
    print(f"mega train: error{_where()}: {timeout}", file=sys.stderr, flush=True)
    write_report(_rank(), run.checkpoint.save, timeout)
    record_failure(TIMEOUT_EXIT_CODE)
    return TIMEOUT_EXIT_CODE


def callback_report(error: CallbackError, save: str | None) -> str:
    """The line for a plugin's callback that raised: who, where, what; where its traceback is (under
    --save/debug, and here with MEGA_PLUGIN_TRACEBACKS=1); the checkpoint the next run resumes from."""
    line = str(error)
    directory = debug_dir(save)
    if directory is not None:
        path = directory / f"callback_error_rank_{_rank()}.txt"
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{line}\n\n{error.traceback}")
        line += f"; traceback in {path}"
    newest = read_tracker(Path(save)) if save else None
    line += (f"; the newest checkpoint (iteration {newest} in {save}) is kept" if newest else
             "; no checkpoint was saved before it" if save else "")
    line += f"; fix the plugin or disable it (MEGA_DISABLE_PLUGINS={error.origin.plugin})"
    if tracebacks_wanted():
        line += "\n" + error.traceback.rstrip()
    elif directory is None:
        line += f" ({TRACEBACKS_VARIABLE}=1 shows the traceback)"
    return line


def announce_node() -> None:
    """In a multi-node job, each node's first rank says which node it is and which ranks it holds."""
    node, nodes = node_of_this_rank()
    if nodes == 1 or not dist.is_initialized() or distributed_env()["local_rank"] != 0:
        return
    first, world = _rank(), dist.get_world_size()
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE") or world // nodes)  # SLURM: the same on every node
    print(f"mega: node {node} of {nodes} ({socket.gethostname()}): ranks {first}-{first + local_size - 1} of {world}",
          file=sys.stderr, flush=True)


def _where() -> str:
    """`` (rank 3 on node 1)`` in a multi-node job, for the error lines: which log to read."""
    return f" ({where(_rank())})" if node_of_this_rank()[1] > 1 else ""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
