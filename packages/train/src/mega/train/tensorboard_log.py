"""TensorBoard scalars (``--tensorboard-dir``), under Megatron's tag names, written by rank 0."""

from __future__ import annotations

import math

from mega.core.config import ConfigError
from mega.core.plugins import hookimpl


class TensorBoardLogger:
    def __init__(self, directory: str):
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional dependency: tensorboard
        except ImportError:
            raise ConfigError(
                "--tensorboard-dir needs the tensorboard package: pip install -c constraints.txt tensorboard "
                "(or mega-train[tensorboard])"
            ) from None
        self._writer_class = SummaryWriter
        self.directory = directory
        self.writer = None

    @hookimpl
    def on_train_start(self, run):
        if run.is_logging_rank:
            self.writer = self._writer_class(log_dir=self.directory)

    @hookimpl
    def on_step_end(self, run, iteration, metrics):
        if self.writer is None:
            return
        tokens = run.derived.global_batch_size * run.config.model.seq_length
        scalars = {
            "lm loss": metrics["loss"],
            "learning-rate": metrics["lr"],
            "loss-scale": metrics["loss_scale"],
            "grad-norm": metrics["grad_norm"],
            "batch-size": run.derived.global_batch_size,
            "iteration-time": metrics["elapsed_s"],
            "throughput tokens/s": tokens / metrics["elapsed_s"],
            # the family's other losses (MoE auxiliary, BERT's sentence loss), under their names
            **{name: value for name, value in metrics.get("losses", {}).items() if name != "lm loss"},
            **metrics.get("straggler", {}),  # --log-straggler's numbers, at its report's iterations
        }
        for tag, value in scalars.items():
            if math.isfinite(value):
                self.writer.add_scalar(tag, value, iteration)
        self.writer.add_scalar("lm loss vs samples", metrics["loss"], run.consumed_samples)

    @hookimpl
    def on_eval(self, run, iteration, metrics):
        if self.writer is not None:
            self.writer.add_scalar("lm loss validation", metrics["loss"], iteration)
            self.writer.add_scalar("lm loss validation ppl", metrics["perplexity"], iteration)

    @hookimpl
    def on_train_end(self, run):
        if self.writer is not None:
            self.writer.close()


def tensorboard_logger(run_config) -> TensorBoardLogger | None:
    directory = run_config.logging.tensorboard_dir
    return TensorBoardLogger(directory) if directory else None
