"""``PolicyEngine``: mega's trainer as the training backend of an outside RL orchestrator.

The contract verl's engine interface and NeMo-RL's policy interface expect of a backend, built on
:class:`mega.train.trainer.Trainer` (its model building, set-up passes, optimizer, learning-rate
schedule and checkpointer; no second training loop):

* ``forward_backward(batch, loss_fn)``: variable-length sequences packed into rows (each
  sequence attends to itself alone: the model's ``document_ids`` mask, positions restarting per
  sequence), the per-token log-probabilities handed to the caller's loss; gradients accumulate
  until ``optimizer_step()``.
* ``logprobs(batch)``: the same log-probabilities without gradients (the old policy, or the
  reference when the policy is a separate copy).
* ``named_hf_tensors()``: the weights as (Hugging Face name, full tensor) pairs, one mapping
  entry at a time, through the family's own Hugging Face mapping (``ModelFamily.hf_mapping``).
* ``offload()`` / ``onload()``: parameters, gradient buffers and optimizer state out of device
  memory into host copies and back; every view of a storage (a parameter inside a gradient
  buffer, say) stays valid, because the storages are emptied and refilled in place.
* ``save(path)`` / ``load(path)``: mega checkpoints (model, optimizer, iteration, RNG), the ones
  ``mega train --load`` reads.

Under pipeline parallelism the packed rows are padded to one length per call (stages send fixed
shapes), the caller's loss runs on the last stage, and ``logprobs`` returns on every stage what
the last one computed. Virtual pipeline stages are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from mega.core.checkpoint.saved_model import saved_model
from mega.core.datasets import TrainingData
from mega.core.parallel import ParallelGroups
from mega.core.pipeline.schedules import forward_backward
from mega.core.plugins import get_plugins
from mega.train.data_setup import run_tokenizer
from mega.train.run_config import derive
from mega.train.run_parser import parse_run
from mega.train.trainer import Trainer


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: an FSDP2 shard's local part (a DTensor's storage is there)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


# The caller's loss: per-sequence log-probabilities (a list of 1-D tensors, token t+1 given the
# tokens up to t) and this micro-batch's slice of the caller's batch -> a scalar.
LossFn = Callable[[list[torch.Tensor], dict], torch.Tensor]


class PolicyEngine:
    """A policy model, its optimizer and its checkpoints, driven by an outside loop."""

    def __init__(self, trainer: Trainer, tokenizer=None):
        if len(trainer.chunks) != 1:
            raise ValueError("PolicyEngine runs one model chunk per rank: no virtual pipeline stages (--num-layers-per-"
                             "virtual-pipeline-stage) yet")
        self.trainer = trainer
        self.tokenizer = tokenizer  # the run's (--tokenizer-type), or None
        self.groups = trainer.groups
        self.chunk = trainer.chunks[0]
        self.model = self.chunk.module  # the language model inside its data-parallel wrapper
        self.step_metrics: list[dict] = []
        self._host: dict | None = None  # offloaded storages: storage -> host copy

    @classmethod
    def from_args(cls, argv: Sequence[str]) -> PolicyEngine:
        """Build from ``mega train``'s flags (the model, layout, optimizer, precision, tokenizer,
        --load...). No training data is read: the batches come from the caller."""
        plugins = get_plugins()
        run, family = parse_run(list(argv))
        return cls.from_run(run, family, plugins)

    @classmethod
    def from_run(cls, run, family, plugins=None) -> PolicyEngine:
        plugins = plugins or get_plugins()
        run, derived = derive(run, dist.get_world_size() if dist.is_initialized() else 1)
        run, tokenizer, spec = run_tokenizer(run, plugins)
        saved = saved_model(run.checkpoint.load, plugins)
        if tokenizer is None and saved is not None and saved.tokenizer is not None:
            spec = saved.tokenizer  # no tokenizer flags: the one the loaded checkpoint carries
            tokenizer = spec.build(plugins)
        groups = ParallelGroups(run.parallel)
        data = TrainingData(train=None, tokenizer=tokenizer, tokenizer_spec=spec)
        return cls(Trainer(run, derived, family, plugins, data, groups), tokenizer)

    @property
    def iteration(self) -> int:
        """Optimizer steps taken (restored by ``load``)."""
        return self.trainer.state.iteration

    # -- packing -----------------------------------------------------------------------------
    def _micro_batches(self, batch: Mapping) -> Iterator[tuple[dict, dict]]:
        """``batch["tokens"]``: a list of 1-D token tensors; every other key a list of the same
        length (one entry per sequence). Yields (model inputs, the caller's slice) per
        micro-batch of ``--micro-batch-size`` sequences, packed into one row."""
        sequences = batch["tokens"]
        for key, values in batch.items():
            if len(values) != len(sequences):
                raise ValueError(f"batch[{key!r}] has {len(values)} entries for {len(sequences)} sequences")
        for index, sequence in enumerate(sequences):
            if sequence.dim() != 1 or len(sequence) < 2:
                raise ValueError(f"sequence {index} must be a 1-D tensor of at least 2 tokens, got shape "
                                 f"{tuple(sequence.shape)}")
        size = self.trainer.run.training.micro_batch_size
        device = self.groups.device
        row = self._row_length(sequences)
        for start in range(0, len(sequences), size):
            part = list(sequences[start:start + size])
            if row is not None:  # pipeline stages send fixed shapes: the rest of the row is one more document
                part.append(torch.zeros(row - sum(len(s) for s in part), dtype=sequences[0].dtype))
            tokens = torch.cat(part).to(device)
            inputs = {
                "tokens": tokens[None],
                "position_ids": torch.cat([torch.arange(len(s)) for s in part]).to(device)[None],
                "document_ids": torch.cat([torch.full((len(s),), i) for i, s in enumerate(part)]).to(device)[None],
            }
            yield inputs, {key: list(values[start:start + size]) for key, values in batch.items()}

    def _row_length(self, sequences) -> int | None:
        """Under pipeline parallelism, the length every packed row is padded to (the longest
        micro-batch's, and one more token, rounded up to a multiple of the tensor group); None
        without (rows are as long as their sequences)."""
        if self.groups.pp.size == 1:
            return None
        size = self.trainer.run.training.micro_batch_size
        longest = max(sum(len(s) for s in sequences[i:i + size]) for i in range(0, len(sequences), size)) + 1
        return -(-longest // self.groups.tp.size) * self.groups.tp.size

    def _schedule(self, micro: list, loss, forward_only: bool) -> None:
        """``micro`` (``_micro_batches``' pairs) through the trainer's pipeline schedule; ``loss``
        runs on the last stage with the model's outputs and the pair."""
        trainer = self.trainer
        row = micro[0][0]["tokens"].shape[1]
        config = dataclasses.replace(trainer.run.model, seq_length=row)

        def boundary(index: int) -> dict:  # one packed row of ``row`` tokens crosses
            return trainer.family.boundary(config, trainer.all_stages[index], 1, trainer.run.parallel, trainer.dtype)

        data = ((inputs, (inputs, caller)) for inputs, caller in micro)
        forward_backward(trainer.chunks, data, len(micro), loss, self.groups, boundary=boundary,
                         reads_batch=[True] * len(trainer.chunks), grad_sync=None if forward_only else trainer.chunks,
                         forward_only=forward_only, schedule=trainer.run.pipeline.pipeline_schedule)

    def _sequence_logprobs(self, outputs: Mapping, inputs: Mapping, lengths: list[int]) -> list[torch.Tensor]:
        if "logits" not in outputs:
            raise ValueError("PolicyEngine needs the model's logits: run without a fused linear-loss kernel")
        tokens = inputs["tokens"]
        labels = torch.roll(tokens, -1, dims=1)  # the last label of each sequence is cut below
        per_token = -self.model.loss(outputs["logits"], labels, self.groups.tp)[0]
        pieces, start = [], 0
        for length in lengths:
            pieces.append(per_token[start:start + length - 1])
            start += length
        return pieces

    # -- the contract ------------------------------------------------------------------------
    def forward_backward(self, batch: Mapping, loss_fn: LossFn) -> list[float]:
        """Forward and backward over ``batch`` (see :meth:`_micro_batches`), micro-batch by
        micro-batch. The gradient is that of the SUM of ``loss_fn``'s values over the
        micro-batches (a token-mean loss divides by the whole batch's token count itself),
        averaged over data-parallel ranks. Returns each micro-batch's loss."""
        self.chunk.train()
        micro = list(self._micro_batches(batch))
        count = len(micro)
        # The schedule means its micro-batches' losses; ours are summed (the caller normalises).
        scale = count * self.trainer.optimizer.loss_scale
        losses: list[float] = []

        def loss(outputs, targets):
            inputs, caller = targets
            logprobs = self._sequence_logprobs(outputs, inputs, [len(s) for s in caller["tokens"]])
            value = loss_fn(logprobs, caller)
            losses.append(float(value.detach()))
            return value * scale

        self._schedule(micro, loss, forward_only=False)
        return losses

    def optimizer_step(self) -> dict:
        """Apply the accumulated gradients (learning rate from the run's schedule), then zero them."""
        trainer, state = self.trainer, self.trainer.state
        lr = trainer.lr_schedule(state.iteration + 1)
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr
        outcome = trainer.optimizer.step()
        if hasattr(trainer.optimizer, "finish_param_sync"):
            trainer.optimizer.finish_param_sync()
        state.iteration += 1
        if not outcome.applied:
            state.skipped_iterations += 1
        self.zero_grad()
        return {"lr": lr, "grad_norm": outcome.grad_norm, "applied": outcome.applied}

    def zero_grad(self) -> None:
        self.chunk.zero_grad_buffer()
        self.trainer.optimizer.zero_grad()

    @torch.no_grad()
    def logprobs(self, batch: Mapping) -> list[torch.Tensor]:
        """Each sequence's per-token log-probabilities (``len - 1`` of them) under the policy as
        it is now, without gradients (dropout off)."""
        self.chunk.eval()
        result = []
        try:
            if self.groups.pp.size == 1:
                for inputs, caller in self._micro_batches(batch):
                    outputs = self.model(inputs)
                    result.extend(self._sequence_logprobs(outputs, inputs, [len(s) for s in caller["tokens"]]))
                return result

            def keep(outputs, targets):  # on the last stage
                inputs, caller = targets
                result.extend(self._sequence_logprobs(outputs, inputs, [len(s) for s in caller["tokens"]]))
                return outputs["logits"].new_zeros(())

            self._schedule(list(self._micro_batches(batch)), keep, forward_only=True)
            # Every stage returns them: the last one has them.
            holder = [[t.cpu() for t in result] if self.groups.pp.is_last else None]
            dist.broadcast_object_list(holder, src=self.groups.pp.ranks[-1], group=self.groups.pp.group)
            return [t.to(self.groups.device) for t in holder[0]]
        finally:
            self.chunk.train()

    @torch.no_grad()
    def named_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) pairs, one mapping entry at a time (a layer's fused
        QKV becomes its q, k and v projections together, then the next entry)."""
        family, config = self.trainer.family, self.trainer.run.model
        if family.hf_mapping is None:
            raise ValueError(f"model family {family.name!r} has no Hugging Face mapping")
        if self.groups.tp.size > 1:
            raise ValueError("named_hf_tensors gathers tensor-parallel shards in a later version; "
                             "run with --tensor-model-parallel-size 1")
        own = dict(self.model.named_parameters())
        for tensor_map in family.hf_mapping.tensor_maps(config):
            tensors = [own[name].detach()[: config.vocab_size] if tensor_map.vocab else own[name].detach()
                       for name in tensor_map.mega]
            yield from zip(tensor_map.other, tensor_map.from_mega(*tensors), strict=True)

    # -- memory ------------------------------------------------------------------------------
    def _storages(self, parameters: bool = True) -> list[torch.Tensor]:
        """One tensor per distinct storage of parameters (unless ``parameters`` is false),
        gradient buffers and optimizer state (fp32 main parameters and moments)."""
        optimizer = self.trainer.optimizer
        params = list(self.chunk.parameters())
        tensors = list(params) if parameters else []
        for buffer in getattr(self.chunk, "grad_buffers", []):
            tensors += [t for t in (buffer.grad_data, buffer.param_data if parameters else None) if t is not None]
        tensors += [entry.main for entry in getattr(optimizer, "main_params", [])]
        inner = getattr(optimizer, "optimizer", optimizer)
        for state in inner.state.values():
            tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
        tensors += [p.grad for p in params if p.grad is not None]
        # A parameter that is its own main parameter (FSDP's shards) stays with the parameters.
        seen = set() if parameters else {_local(p).untyped_storage().data_ptr() for p in params}
        unique = []
        for tensor in tensors:
            storage = _local(tensor).untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            unique.append(tensor)
        return unique

    def offload(self, parameters: bool = True) -> None:
        """Move parameters (unless ``parameters`` is false: the optimizer state and gradient
        buffers alone, ``--rl-offload-optimizer-during-inference``), gradient buffers and optimizer
        state into host memory, freeing their device storage (refilled in place by :meth:`onload`)."""
        if self._host is not None:
            raise RuntimeError("offload() twice without onload()")
        self._host = []
        for tensor in self._storages(parameters):
            storage = _local(tensor).untyped_storage()
            copy = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu",
                               pin_memory=torch.cuda.is_available() and storage.device.type == "cuda")
            copy.untyped_storage().copy_(storage)
            self._host.append((storage, copy))
            storage.resize_(0)

    def onload(self) -> None:
        """Refill every storage :meth:`offload` emptied, in place (every view stays valid)."""
        if self._host is None:
            raise RuntimeError("onload() without offload()")
        for storage, copy in self._host:
            storage.resize_(copy.numel())
            storage.copy_(copy.untyped_storage())
        self._host = None

    # -- checkpoints -------------------------------------------------------------------------
    def _checkpointer(self, **where):
        # Start-up cost: torch.distributed.checkpoint takes a second to import.
        from mega.train.checkpoint.checkpointer import Checkpointer, TrainingState

        trainer = self.trainer
        state = TrainingState(trainer.chunks, trainer.optimizer, trainer.rng_tracker, trainer.state, trainer.family,
                              trainer.run, whole_model_on_meta=trainer._whole_model_on_meta,
                              tokenizer_spec=trainer.tokenizer_spec, events=trainer.events)
        config = dataclasses.replace(trainer.run.checkpoint, async_save=False, **where)
        return Checkpointer(config, self.groups, state)

    def save(self, path: str | Path) -> Path:
        """A mega checkpoint of the policy, optimizer, iteration and RNG under ``path``."""
        own = self.trainer.checkpointer
        if own is not None and self.trainer.run.checkpoint.save == str(path):
            path = own.save()  # the run's --save: its checkpointer holds the directory's lock
            own.wait()
            return path
        checkpointer = self._checkpointer(save=str(path))
        try:
            return checkpointer.save()
        finally:
            checkpointer.close()

    def close(self) -> None:
        """Finish a background save and release the run's --save directory."""
        if self.trainer.checkpointer is not None:
            self.trainer.checkpointer.close()

    def load(self, path: str | Path) -> None:
        """Restore what :meth:`save` wrote (the newest checkpoint under ``path``)."""
        checkpointer = self._checkpointer(load=str(path), finetune=False)
        try:
            checkpointer.load()
        finally:
            checkpointer.close()
