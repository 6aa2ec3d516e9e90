"""Run one training job in this process (one rank of it): the glue behind `mega train`."""

from __future__ import annotations

import sys

import torch.distributed as dist

from mega.core.checkpoint import CheckpointError
from mega.core.config import ConfigError
from mega.core.model_family import ModelFamily
from mega.core.parallel import ParallelGroups
from mega.core.plugins import PluginError, get_plugins
from mega.core.process_group import init_distributed
from mega.core.rank_exit import record_failure
from mega.train.collective_timeout import describe_timeout
from mega.train.data_setup import build_datasets
from mega.train.hang_report import flight_recorder_env, write_report
from mega.train.in_job_restart import resume_after_restart
from mega.train.launch import TIMEOUT_EXIT_CODE
from mega.train.run_config import RunConfig, derive
from mega.train.trainer import RunState, Trainer


def run_training(run: RunConfig, family: ModelFamily, plugins=None) -> RunState:
    """Train in this process (joining the distributed job its environment describes)."""
    plugins = plugins or get_plugins()
    run = resume_after_restart(run)
    flight_recorder_env(run.checkpoint.save)
    init_distributed(timeout_s=run.training.distributed_timeout_minutes * 60)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    run, derived = derive(run, world_size)
    groups = ParallelGroups(run.parallel)
    run, data = build_datasets(run, derived, plugins)
    trainer = Trainer(run, derived, family, plugins, data, groups)
    return trainer.train()


def train(run: RunConfig, family: ModelFamily) -> int:
    """`mega train`'s exit code: 0, or 2 with one clear line for a configuration problem."""
    try:
        run_training(run, family)
    except (ConfigError, PluginError, CheckpointError, ValueError, FileNotFoundError) as error:
        # Recorded before the process group closes, so it precedes the peers' broken collectives.
        record_failure(2)
        print(f"mega train: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        timeout = describe_timeout(error, run.training.distributed_timeout_minutes)
        if timeout is None:
            raise
        print(f"mega train: error: {timeout}", file=sys.stderr, flush=True)
        write_report(dist.get_rank() if dist.is_initialized() else 0, run.checkpoint.save, timeout)
        record_failure(TIMEOUT_EXIT_CODE)
        return TIMEOUT_EXIT_CODE
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
