"""Weights & Biases (``--wandb-project``): the console line's metrics and the run's configuration,
logged by rank 0 under Megatron's TensorBoard tag names.

``WANDB_MODE=offline`` writes the run under ``--wandb-save-dir``/wandb (default ``--save``/wandb,
else ./wandb) without a network (``wandb sync``
uploads it later). The values are those of the console line (see interval_metrics), so a curve in
W&B and the log file never disagree.
"""

from __future__ import annotations

import dataclasses
import json
import os

from mega.core.config import ConfigError
from mega.core.plugins import hookimpl
from mega.train.interval_metrics import IntervalMetrics
from mega.train.log_line import LogRecord


def record_scalars(record: LogRecord) -> dict[str, float]:
    """A log line's values under Megatron's tags (throughput is TFLOP/s per GPU, as in Megatron)."""
    scalars = {
        "lm loss": record.loss,
        "learning-rate": record.learning_rate,
        "loss-scale": record.loss_scale,
        "batch-size": record.global_batch_size,
        "iteration-time": record.elapsed_ms / 1000,
        "consumed-samples": record.consumed_samples,
        "skipped-iterations": record.skipped_iterations,
        "nan-iterations": record.nan_iterations,
        **(record.other_losses or {}),
    }
    optional = {"grad-norm": record.grad_norm, "throughput": record.tflops_per_gpu,
                "tokens-per-second-per-gpu": record.tokens_per_second_per_gpu, "mfu": record.mfu,
                "peak-memory-gb": record.peak_memory_gb}
    scalars.update({name: value for name, value in optional.items() if value is not None})
    return scalars


class WandbLogger:
    def __init__(self, project: str, name: str | None, directory: str, log_interval: int,
                 peak_override: float | None):
        try:
            import wandb  # optional dependency (mega-train[wandb])
        except ImportError:
            raise ConfigError("--wandb-project needs the wandb package: pip install wandb "
                              "(or mega-train[wandb])") from None
        self._wandb = wandb
        self.project, self.name, self.directory = project, name, directory
        self.interval = IntervalMetrics(log_interval, peak_override)
        self.run = None

    @hookimpl
    def on_train_start(self, run):
        if not run.is_logging_rank:
            return
        os.makedirs(self.directory, exist_ok=True)
        config = json.loads(json.dumps(dataclasses.asdict(run.config), default=str))
        config["derived"] = dataclasses.asdict(run.derived)
        self.run = self._wandb.init(project=self.project, name=self.name, dir=self.directory, config=config)

    @hookimpl
    def on_step_end(self, run, iteration, metrics):
        record = self.interval.add(run, iteration, metrics)
        if record is None or self.run is None:
            return
        scalars = record_scalars(record)
        scalars.update(metrics.get("straggler", {}))  # the straggler report, when --log-straggler made one
        self.run.log(scalars, step=iteration)

    @hookimpl
    def on_eval(self, run, iteration, metrics):
        if self.run is not None:
            self.run.log({"lm loss validation": metrics["loss"],
                          "lm loss validation ppl": metrics["perplexity"]}, step=iteration)

    @hookimpl
    def on_train_end(self, run):
        if self.run is not None:
            self.run.finish(exit_code=0 if run.finished else 1)
            self.run = None
            # finish() returns before wandb's service has written the run's files; its teardown
            # waits for that, so the run is complete on disk when training returns.
            self._wandb.teardown()


def wandb_logger(run_config) -> WandbLogger | None:
    logging = run_config.logging
    if not logging.wandb_project:
        return None
    # wandb.init(dir=D) writes under D/wandb (Megatron passes --wandb-save-dir as D): --save
    # as D puts the run in --save/wandb.
    directory = logging.wandb_save_dir or run_config.checkpoint.save or "."
    return WandbLogger(logging.wandb_project, logging.wandb_exp_name, directory, logging.log_interval,
                       logging.peak_tflops)
