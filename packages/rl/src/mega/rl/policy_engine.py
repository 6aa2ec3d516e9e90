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
  entry at a time, through the family's own Hugging Face mapping (``ModelFamily.hf_mapping``); a
  LoRA policy's adapted weights merged (the model it computes).
* ``offload()`` / ``onload()``: parameters, gradient buffers and optimizer state out of device
  memory into host copies and back; every view of a storage (a parameter inside a gradient
  buffer, say) stays valid, because the storages are emptied and refilled in place.
* ``save(path)`` / ``load(path)``: mega checkpoints (model, optimizer, iteration, RNG), the ones
  ``mega train --load`` reads.

Every rank of the job makes the same calls in the same order (they are collectives). Layouts:

* Tensor and pipeline parallelism: every rank of one model replica passes the same batch. The
  micro-batches run through the run's pipeline schedule (``--pipeline-schedule``), the caller's
  loss on the last stage, where the logits are; ``logprobs`` and the losses ``forward_backward``
  returns are broadcast from there, so every rank sees the same answer. Log-probabilities come
  from the vocabulary-parallel cross-entropy. Under pipeline parallelism the rows of a call are
  padded to one length, under sequence parallelism to a multiple of tp (the padding is a
  document of its own at the row's end: no sequence sees it).
* Data parallelism (DDP, the distributed optimizer, FSDP2; experts under expert parallelism):
  each data-parallel rank passes its OWN share of the batch, as verl's engines and NeMo-RL's
  policy workers receive theirs from their controller. The gradient is the mean over the
  data-parallel ranks of each one's summed losses (the averaging of Megatron's DDP, and FSDP's),
  so for the update one process would take on the whole batch the loss is normalised over the
  whole batch and multiplied by the data-parallel size, as verl's ``agg_loss`` does: a token-mean
  divides its share's sum by ``data_parallel_sum(share's token count)`` and multiplies by
  ``data_parallel_size``. Under expert parallelism the ranks' shares make as many micro-batches
  (their experts exchange tokens every micro-batch; rows are padded to one length across them).
  A MoE policy's auxiliary losses (``--moe-aux-loss-coeff``, ``--moe-z-loss-coeff``) are added to
  the caller's loss, each micro-batch's averaged over the micro-batches, as Megatron does: they
  are each rank's, over its own share's tokens (so under data or expert parallelism they differ
  from one process's over the whole batch, as the router's statistics do).
* Context parallelism is refused for now.
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
from mega.core.parallel.output_layer_loss import output_layer_cross_entropy
from mega.core.pipeline.schedules import forward_backward
from mega.core.plugins import get_plugins
from mega.models.mixtral.model import MOE_STATS, moe_auxiliary_loss
from mega.rl.full_tensors import FullTensors
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
        if trainer.groups.cp.size > 1:
            raise ValueError("PolicyEngine runs without context parallelism for now (--context-parallel-size 1)")
        self.trainer = trainer
        self.tokenizer = tokenizer  # the run's (--tokenizer-type), or None
        self.groups = trainer.groups
        self.chunk = trainer.chunks[0]
        self.model = self.chunk.module  # this rank's (first) stage inside its data-parallel wrapper
        # The chunk that holds the last stage (on the last pipeline rank) computes the loss.
        last = [chunk for chunk, stage in zip(trainer.chunks, trainer.stages, strict=True) if stage.is_last]
        self.loss_model = last[0].module if last else None
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
    def _micro_batches(self, batch: Mapping) -> list[tuple[dict, dict]]:
        """``batch["tokens"]``: a list of 1-D token tensors; every other key a list of the same
        length (one entry per sequence). (model inputs, the caller's slice) per micro-batch of
        ``--micro-batch-size`` sequences packed into one row, padded where the layout needs it
        (:meth:`_row_lengths`); the padding is a document of its own at the row's end, so no
        sequence sees it."""
        sequences = batch["tokens"]
        if len(sequences) == 0:
            raise ValueError("the batch has no sequences (batch['tokens'] is empty): every rank passes at least one")
        for key, values in batch.items():
            if len(values) != len(sequences):
                raise ValueError(f"batch[{key!r}] has {len(values)} entries for {len(sequences)} sequences")
        for index, sequence in enumerate(sequences):
            if sequence.dim() != 1 or len(sequence) < 2:
                raise ValueError(f"sequence {index} must be a 1-D tensor of at least 2 tokens, got shape "
                                 f"{tuple(sequence.shape)}")
        size = self.trainer.run.training.micro_batch_size
        parts = [range(start, min(start + size, len(sequences))) for start in range(0, len(sequences), size)]
        lengths = self._row_lengths([sum(len(sequences[i]) for i in part) for part in parts])
        device = self.groups.device
        micro = []
        for part, length in zip(parts, lengths, strict=True):
            pieces = [sequences[i] for i in part]
            pad = length - sum(len(s) for s in pieces)
            inputs = {
                "tokens": torch.cat([*pieces, torch.zeros(pad, dtype=pieces[0].dtype)]).to(device)[None],
                "position_ids": torch.cat([*(torch.arange(len(s)) for s in pieces),
                                           torch.zeros(pad, dtype=torch.long)]).to(device)[None],
                "document_ids": torch.cat([*(torch.full((len(s),), i) for i, s in enumerate(pieces)),
                                           torch.full((pad,), len(pieces))]).to(device)[None],
            }
            micro.append((inputs, {key: [values[i] for i in part] for key, values in batch.items()}))
        return micro

    def _row_lengths(self, lengths: list[int]) -> list[int]:
        """Each micro-batch's row length, padded where the layout needs it: one length for all
        under pipeline parallelism (the boundary between stages has one shape) and under expert
        parallelism (the experts' token exchange runs every micro-batch on every expert-parallel
        peer, with rows of one length: the allgather dispatcher), agreed with those peers; a
        multiple of tp under sequence parallelism (the row is split over the tensor group)."""
        ep = self.groups.ep
        if self.groups.pp.size > 1 or ep.size > 1:
            common = max(lengths, default=0)
            if ep.size > 1:
                agreed = torch.tensor([common, len(lengths), -len(lengths)], device=self.groups.device)
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=ep.group)
                if agreed[1] != -agreed[2]:
                    other = int(agreed[1]) if agreed[1] != len(lengths) else int(-agreed[2])
                    raise ValueError(f"under expert parallelism every data-parallel rank passes as many micro-batches "
                                     f"(of --micro-batch-size sequences): this rank has {len(lengths)}, another {other}")
                common = int(agreed[0])
            lengths = [common] * len(lengths)
        if self.trainer.run.parallel.sequence_parallel:
            tp = self.groups.tp.size
            lengths = [-(-length // tp) * tp for length in lengths]
        return lengths

    def _boundary(self, length: int):
        """What crosses between pipeline stages for rows of ``length`` tokens (the family says)."""
        trainer = self.trainer
        model = trainer.run.model
        config = dataclasses.replace(model, seq_length=length,
                                     max_position_embeddings=max(length, model.max_position_embeddings or 0))
        return lambda index: trainer.family.boundary(config, trainer.all_stages[index], 1, trainer.run.parallel,
                                                     trainer.dtype)

    def _run(self, micro: list[tuple[dict, dict]], loss, forward_only: bool) -> None:
        """``micro`` through the run's pipeline schedule (every stage reads the rows' documents
        and positions); ``loss(outputs, (inputs, caller slice))`` on the last stage."""
        trainer = self.trainer
        length = micro[0][0]["tokens"].shape[1] if micro else 0
        forward_backward(trainer.chunks, ((inputs, (inputs, caller)) for inputs, caller in micro), len(micro), loss,
                         self.groups, boundary=self._boundary(length) if self.groups.pp.size > 1 else None,
                         reads_batch=[True] * len(trainer.chunks),
                         grad_sync=None if forward_only else trainer.chunks, forward_only=forward_only,
                         schedule=trainer.run.pipeline.pipeline_schedule)

    def _from_last_stage(self, values: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
        """The last stage's ``values`` (1-D, of ``sizes``) concatenated, on every pipeline rank."""
        flat = torch.cat(values).float() if values else torch.empty(sum(sizes), device=self.groups.device)
        pp = self.groups.pp
        if pp.size > 1:
            flat = flat.to(self.groups.device)
            dist.broadcast(flat, src=pp.ranks[self.trainer.loss_rank], group=pp.group)
        return flat

    def _sequence_logprobs(self, outputs: Mapping, inputs: Mapping, lengths: list[int]) -> list[torch.Tensor]:
        tokens = inputs["tokens"]
        labels = torch.roll(tokens, -1, dims=1)  # the last label of each sequence is cut below
        if "logits" in outputs:
            per_token = -self.loss_model.loss(outputs["logits"], labels, self.groups.tp)[0]
        elif "output_hidden" in outputs and not self.loss_model.fused_loss:
            # A zero-bubble schedule's last stage leaves the output layer to the loss (its weight
            # gradient to W): the layer and the vocabulary-parallel cross-entropy in one.
            hidden = outputs["output_hidden"]
            per_token = -output_layer_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), outputs["output_weight"],
                                                    labels[0], self.groups.tp, self.trainer.run.model.vocab_size)
        else:
            raise ValueError("PolicyEngine needs the model's logits: run without a fused linear-loss kernel")
        pieces, start = [], 0
        for length in lengths:
            pieces.append(per_token[start:start + length - 1])
            start += length
        return pieces

    # -- the contract ------------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        return self.groups.dp.size

    def data_parallel_sum(self, value: float) -> float:
        """``value`` summed over the data-parallel ranks (a collective): the whole batch's count
        of tokens or sequences from each rank's share, to normalise a loss by."""
        total = torch.tensor([float(value)], dtype=torch.float64, device=self.groups.device)
        if self.groups.dp.size > 1:
            dist.all_reduce(total, group=self.groups.dp.group)
        return float(total)

    def forward_backward(self, batch: Mapping, loss_fn: LossFn) -> list[float]:
        """Forward and backward over ``batch`` (see :meth:`_micro_batches`), micro-batch by
        micro-batch, through the run's pipeline schedule; ``loss_fn`` runs on the last stage.
        The gradient is that of the SUM of ``loss_fn``'s values over the micro-batches (a
        token-mean loss divides by the whole batch's token count itself), averaged over
        data-parallel ranks (see the module's docstring). Returns each micro-batch's loss, the
        same on every rank of the pipeline."""
        for chunk in self.trainer.chunks:
            chunk.train()
        micro = self._micro_batches(batch)
        # The schedule means its micro-batches' losses; ours are summed (the caller normalises).
        scale = len(micro) * self.trainer.optimizer.loss_scale
        losses: list[torch.Tensor] = []

        config = self.trainer.run.model

        def loss(outputs, targets):
            inputs, caller = targets
            value = loss_fn(self._sequence_logprobs(outputs, inputs, [len(s) for s in caller["tokens"]]), caller)
            losses.append(value.detach().reshape(1))
            if MOE_STATS in outputs:
                # A MoE policy's routers keep their load-balancing (and z-) losses, as Megatron's
                # MoE layers add them to whatever loss trains: each micro-batch's, averaged.
                value = value + moe_auxiliary_loss(outputs[MOE_STATS], config) / len(micro)
            return value * scale

        self._run(micro, loss, forward_only=False)
        return self._from_last_stage(losses, [1] * len(micro)).tolist()

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
        for chunk in self.trainer.chunks:
            chunk.zero_grad_buffer()
        self.trainer.optimizer.zero_grad()

    @torch.no_grad()
    def logprobs(self, batch: Mapping) -> list[torch.Tensor]:
        """Each sequence's per-token log-probabilities (``len - 1`` of them, fp32) under the
        policy as it is now, without gradients (dropout off); computed on the last pipeline
        stage and broadcast, so every rank returns the same."""
        chunks = self.trainer.chunks
        for chunk in chunks:
            chunk.eval()
        micro = self._micro_batches(batch)
        pieces: list[torch.Tensor] = []

        def collect(outputs, targets):
            inputs, caller = targets
            pieces.extend(self._sequence_logprobs(outputs, inputs, [len(s) for s in caller["tokens"]]))
            return torch.zeros((), device=self.groups.device)

        try:
            self._run(micro, collect, forward_only=True)
        finally:
            # FSDP2 units a forward alone leaves gathered (those that do not reshard after forward)
            # would hold the whole weights until the next forward. (Start-up cost: imported here.)
            from mega.core.checkpoint.state import settle

            settle(chunks, None)
            for chunk in chunks:
                chunk.train()
        sizes = [len(s) - 1 for s in batch["tokens"]]
        return list(self._from_last_stage(pieces, sizes).split(sizes))

    @torch.no_grad()
    def named_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) pairs, one mapping entry at a time (a layer's fused
        QKV becomes its q, k and v projections together, then the next entry), gathered from
        every layout (:mod:`mega.rl.full_tensors`): the same on every rank, which must all
        consume the iterator to its end (each entry is a collective)."""
        family, config = self.trainer.family, self.trainer.run.model
        if family.hf_mapping is None:
            raise ValueError(f"model family {family.name!r} has no Hugging Face mapping")
        # A LoRA policy's weights come merged: the Hugging Face names hold the model it computes.
        full = FullTensors(self.trainer.chunks, self.groups, config.vocab_size, self.trainer.optimizer, merge_lora=True)
        for tensor_map in family.hf_mapping.tensor_maps(config):
            tensors = [full[name] for name in tensor_map.mega]
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
