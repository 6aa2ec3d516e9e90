"""The training loop: build the model for this rank, then step it through the schedule.

    groups -> model chunks from the family, set up by the ordered passes (parallel layout, LoRA,
    FP8, recompute, compile, tying, DDP/FSDP2) -> optimizer
    -> for each iteration: forward_backward (no pipelining / 1F1B / interleaved / ZB-H1) -> step -> hooks

Everything optional (logging, TensorBoard, profiling, the pipeline timeline) is a listener of
the run's events, not a branch here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mega.core.build import build_model, build_stage
from mega.core.datasets import TrainingData
from mega.core.kernels import Kernels
from mega.core.model_family import LossContext, ModelFamily
from mega.core.optim.build import build_optimizer
from mega.core.parallel import ParallelGroups
from mega.core.parallel.context_parallel import split_batch
from mega.core.parallel.random import seed_parallel_rng
from mega.core.pipeline.actions import rank_and_chunk_of, stage_of
from mega.core.pipeline.layout import layers_per_stage
from mega.core.pipeline.schedules import forward_backward
from mega.core.pipeline.zero_bubble import placement_of
from mega.core.plugins import Plugins
from mega.core.setup_passes import registered_passes
from mega.train.batches import MicroBatches
from mega.train.callback_errors import events_from_callbacks
from mega.train.lr_schedule import LearningRateSchedule
from mega.train.model_passes import build_dtype
from mega.train.per_token_loss import micro_batch_tokens, read_step, token_weight
from mega.train.precision import (
    grad_scaler_for,
    model_dtype,
)
from mega.train.run_config import Derived, RunConfig


@dataclass
class RunState:
    """What listeners see of a run (``run`` in every event)."""

    config: RunConfig
    derived: Derived
    groups: ParallelGroups
    family: ModelFamily
    flops_per_iteration: float
    iteration: int = 0
    consumed_samples: int = 0
    consumed_valid_samples: int = 0  # as Megatron, each evaluation continues where the last stopped
    skipped_iterations: int = 0
    nan_iterations: int = 0
    losses: list[float] = field(default_factory=list)
    finished: bool = False  # set when the loop ends normally; on_train_end also runs after a failure
    exit_reason: str | None = None  # a listener's reason to save and stop now (a preemption signal...)

    @property
    def is_logging_rank(self) -> bool:
        return self.groups.global_rank == 0


class Trainer:
    def __init__(self, run: RunConfig, derived: Derived, family: ModelFamily, plugins: Plugins,
                 data: TrainingData, groups: ParallelGroups | None = None):
        self.run, self.derived, self.family = run, derived, family
        self.groups = groups or ParallelGroups(run.parallel)
        self.dtype = model_dtype(run.precision)
        seed = run.training.seed
        torch.manual_seed(seed)
        self.rng_tracker = seed_parallel_rng(seed, self.groups)
        self.kernels = Kernels(run.kernels.selection(), plugins)
        self.loss_context = LossContext(run.model, self.groups.tp, self.kernels, self.groups.cp)
        pp, vpp = self.groups.pp.size, run.parallel.vpp or 1
        uneven = layers_per_stage(run.pipeline, getattr(run.model, "num_layers", 0), pp, vpp)
        self.all_stages = family.stages(run.model, pp, vpp, uneven)
        # Virtual stage c * pp + r is model chunk c of pipeline rank r (interleaved order); in a V
        # (zbv, dualpipev) rank r's second chunk is stage 2 pp - 1 - r, and rank 0 has the loss.
        placement = placement_of(run.pipeline.pipeline_schedule)
        self.stages = [self.all_stages[stage_of(self.groups.pp.rank, chunk, pp, placement)] for chunk in range(vpp)]
        self.loss_rank = rank_and_chunk_of(pp * vpp - 1, pp, placement)[0]
        # Under context parallelism every stage reads its chunks' positions (RoPE in every layer).
        # Rows of several documents: every stage reads their documents and positions too.
        self.reads_batch = [bool(stage.batch_keys) or stage.is_last or self.groups.cp.size > 1
                            or run.data.per_document for stage in self.stages]
        self._token_weight = None  # --calculate-per-token-loss: set per step by _run_schedule
        self.events = events_from_callbacks(plugins, run)
        self.chunks = self._build_model_chunks(plugins)
        self.optimizer = build_optimizer(self.chunks, self.groups, run.optimizer, grad_scaler_for(run.precision),
                                         plugins)
        train_iters = run.training.train_iters
        self.lr_schedule = LearningRateSchedule(
            lr=run.optimizer.lr, min_lr=run.optimizer.min_lr, style=run.optimizer.lr_decay_style,
            warmup_iters=run.optimizer.lr_warmup_iters, decay_iters=run.optimizer.lr_decay_iters or train_iters,
        )
        self.train_data, self.valid_data = data.train, data.valid
        self.tokenizer_spec = data.tokenizer_spec
        flops = family.num_floating_point_operations(run.model, derived.global_batch_size)
        self.state = RunState(run, derived, self.groups, family, flops)
        self.checkpointer = None
        if run.checkpoint.save or run.checkpoint.load:
            self.checkpointer = self._checkpointer()
        if run.checkpoint.load:
            self.checkpointer.load()

    def _checkpointer(self):
        # Start-up cost: torch.distributed.checkpoint takes a second to import; a run that neither
        # saves nor loads does not pay it.
        from mega.train.checkpoint.checkpointer import Checkpointer, TrainingState

        state = TrainingState(self.chunks, self.optimizer, self.rng_tracker, self.state, self.family, self.run,
                              whole_model_on_meta=self._whole_model_on_meta, tokenizer_spec=self.tokenizer_spec,
                              events=self.events)
        return Checkpointer(self.run.checkpoint, self.groups, state)

    def _whole_model_on_meta(self):
        run = self.run
        return build_stage(self.family, run.model, parallel=run.parallel, device="meta")

    # -- building ---------------------------------------------------------------------------
    def _build_model_chunks(self, plugins: Plugins) -> list[nn.Module]:
        """This rank's model chunks (virtual stages ``rank``, ``rank + pp``, ...), built by
        :func:`build_model` and set up by one ordered list of passes (:mod:`mega.core.setup_passes`):
        the family's, then the run's that plugins register (LoRA, FP8, ``--compile``, weight tying,
        DDP or FSDP2), in phase order. Listeners see each finished chunk (``on_stage_built``)."""
        run = self.run
        chunks = build_model(self.family, run.model, self.stages, groups=self.groups, kernels=self.kernels,
                             rng_tracker=self.rng_tracker, seed=run.training.seed, dtype=build_dtype(run),
                             passes=registered_passes(plugins, run), run=run)
        for chunk in chunks:
            self.events.hook.on_stage_built(stage=chunk, groups=self.groups)
        return chunks

    def _boundary(self, index: int) -> dict:
        """What virtual stage ``index`` sends to the next one (the family says)."""
        return self.family.boundary(self.run.model, self.all_stages[index], self.run.training.micro_batch_size,
                                    self.run.parallel, self.dtype)

    # -- one step ---------------------------------------------------------------------------
    def _loss_fn(self, outputs, batch: dict) -> torch.Tensor:
        loss, metrics = self.family.loss(outputs, batch, self.loss_context)
        if self._token_weight is not None:  # --calculate-per-token-loss (see per_token_loss)
            weight = micro_batch_tokens(batch["loss_mask"], self.groups.cp) * self._token_weight
            loss = loss * weight
            metrics = {**metrics, "lm loss": metrics["lm loss"] * weight} if "lm loss" in metrics else metrics
        self._metrics.append(metrics)
        return loss

    def _microbatches(self, dataset, consumed_samples: int) -> Iterator:
        """The micro-batches of this rank as ``(batch, batch)``: the stages read the batch's
        fields, the loss its labels and masks (nothing on ranks none of whose stages read them)."""
        if not any(self.reads_batch):
            return iter(())
        stage_keys = tuple(key for stage in self.all_stages for key in stage.batch_keys)
        batches = MicroBatches(dataset, self.run, self.groups, consumed_samples, self.groups.device,
                               self.family.batch_keys, stage_keys)
        if self.groups.cp.size > 1:  # each context rank keeps its two chunks of every sequence
            per_document = self.run.data.packed_sequences  # packed conversations: split per document
            batches = (split_batch(batch, self.groups.cp, self.run.model.seq_length, per_document=per_document)
                       for batch in batches)
        return ((batch, batch) for batch in batches)

    def _run_schedule(self, data: Iterator, forward_only: bool) -> float:
        """One global batch forward (and backward); the mean of the family's ``lm loss`` (of the
        loss it differentiates if it names none), known on every rank; the means of all its
        metrics, likewise, in ``self.last_metrics``."""
        # fp16: the schedule differentiates the scaled loss; the optimizer unscales the gradients.
        scale = 1.0 if forward_only else self.optimizer.loss_scale
        loss_fn = self._loss_fn if scale == 1.0 else (lambda output, batch: self._loss_fn(output, batch) * scale)
        self._metrics = []
        self._token_weight = None
        if self.run.training.calculate_per_token_loss and self.groups.is_pipeline_last:
            step = read_step(data, self.derived.num_microbatches)
            self._token_weight = token_weight(step, self.derived.num_microbatches, self.groups.dp, self.groups.cp,
                                              self.groups.dp_cp)
            data = iter(step)
        losses = forward_backward(
            self.chunks, data, self.derived.num_microbatches, loss_fn, self.groups,
            boundary=self._boundary, reads_batch=self.reads_batch,
            grad_sync=None if forward_only else self.chunks, events=self.events, forward_only=forward_only,
            schedule=self.run.pipeline.pipeline_schedule,
        )
        return self._mean_over_ranks([loss / scale for loss in losses], self._metrics)

    def _mean_over_ranks(self, losses: list[torch.Tensor], metrics: list[dict]) -> float:
        """Average the last stage's micro-batch loss and metrics over data-parallel ranks and
        share them with every pipeline stage (the last stage is on the first rank in a V)."""
        summary = None
        if self.groups.pp.rank == self.loss_rank:
            names = sorted(metrics[0]) if metrics else []
            values = [torch.stack(losses).float().mean()] + [
                torch.stack([m[name].float() for m in metrics]).mean() for name in names]
            total = torch.stack(values).to(self.groups.device)
            if self.groups.dp_cp.size > 1:
                dist.all_reduce(total, group=self.groups.dp_cp.group)
                total /= self.groups.dp_cp.size
            summary = [total[0].item(), dict(zip(names, total[1:].tolist(), strict=True))]
        if self.groups.pp.size > 1:
            shared = [summary]
            dist.broadcast_object_list(shared, src=self.groups.pp.ranks[self.loss_rank], group=self.groups.pp.group)
            summary = shared[0]
        loss, self.last_metrics = summary
        return self.last_metrics.get("lm loss", loss)

    def train_step(self, data: Iterator) -> dict:
        state = self.state
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.lr_schedule(state.iteration + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self._run_schedule(data, forward_only=False)
        outcome = self.optimizer.step()
        state.iteration += 1
        state.consumed_samples += self.derived.global_batch_size
        if not math.isfinite(loss):
            state.nan_iterations += 1
        if not outcome.applied:
            state.skipped_iterations += 1
        state.losses.append(loss)
        return {"loss": loss, "losses": self.last_metrics, "lr": lr, "grad_norm": outcome.grad_norm,
                "loss_scale": outcome.loss_scale, "applied": outcome.applied}

    # -- the loop ---------------------------------------------------------------------------
    def train(self) -> RunState:
        state, hooks = self.state, self.events.hook
        train_iters = self.run.training.train_iters
        data = self._microbatches(self.train_data, state.consumed_samples)
        hooks.on_train_start(run=state)
        try:
            while state.iteration < train_iters:
                hooks.on_step_start(run=state, iteration=state.iteration + 1)
                start = time.perf_counter()
                metrics = self.train_step(data)
                if hasattr(self.optimizer, "finish_param_sync"):
                    self.optimizer.finish_param_sync()
                metrics["elapsed_s"] = time.perf_counter() - start
                hooks.on_optimizer_step_end(run=state, iteration=state.iteration)
                hooks.on_step_end(run=state, iteration=state.iteration, metrics=metrics)
                if self.valid_data is not None and self.run.training.eval_iters and (
                    state.iteration % self.run.training.eval_interval == 0 or state.iteration == train_iters
                ):
                    hooks.on_eval(run=state, iteration=state.iteration, metrics=self.evaluate())
                exiting = state.iteration == train_iters or state.exit_reason is not None or bool(
                    self.run.training.exit_interval and state.iteration % self.run.training.exit_interval == 0)
                if self.checkpointer is not None:
                    self.checkpointer.poll()
                    self.checkpointer.maybe_save(state.iteration, last=exiting)
                if exiting:
                    break
            if self.checkpointer is not None:
                self.checkpointer.close()
            state.finished = True
        finally:
            hooks.on_train_end(run=state)
        return state

    def evaluate(self) -> dict:
        """The next ``--eval-iters`` global batches of the validation set, forward only."""
        for chunk in self.chunks:
            chunk.eval()
        data = self._microbatches(self.valid_data, self.state.consumed_valid_samples)
        with torch.no_grad():
            losses = [self._run_schedule(data, forward_only=True) for _ in range(self.run.training.eval_iters)]
        self.state.consumed_valid_samples += self.run.training.eval_iters * self.derived.global_batch_size
        for chunk in self.chunks:
            chunk.train()
        loss = sum(losses) / len(losses)
        return {"loss": loss, "perplexity": math.exp(min(20.0, loss))}
