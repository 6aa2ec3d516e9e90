"""Weight refresh: the trainer's weights into the rollout engine's own model, without disk.

After an optimizer step the trainer's weights sit in its layout: tensor- and pipeline-parallel
shards, FSDP2's row shards, expert shards, copies on every data-parallel rank (with or without
the distributed optimizer). The engine holds every layer at its own tensor-parallel size. A
refresh makes each weight whole by its mega (Megatron-Core) name, one tensor at a time
(:class:`~mega.rl.full_tensors.FullTensors`, the gather ``PolicyEngine.named_hf_tensors`` uses
too), and each engine rank keeps its shard of it through the checkpoint loader's
:func:`~mega.core.checkpoint.load_model_weights` (what the inference loader does with a Hugging
Face directory), so every element lands where a save at the training layout and a load at the
engine's would put it. A LoRA policy's engine holds the merged weights (no adapters): the gather
merges each adapted layer's (``merge_lora``).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from mega.core.checkpoint import load_model_weights
from mega.core.checkpoint.state import MODEL, model_entries
from mega.core.parallel import ParallelGroups
from mega.rl.full_tensors import FullTensors


class WeightSync:
    """Copies the weights of ``chunks`` (the trainer's model chunks on this rank, laid out over
    ``train_groups``) into ``engine_model`` (built whole over ``engine_groups``' tensor group).
    Collective: every rank of the world constructs it and calls :meth:`refresh` together."""

    def __init__(self, chunks: list[nn.Module], train_groups: ParallelGroups, engine_model: nn.Module,
                 engine_groups: ParallelGroups, vocab_size: int, optimizer=None):
        self.chunks, self.train_groups, self.vocab_size, self.optimizer = chunks, train_groups, vocab_size, optimizer
        self.engine_model, self.engine_groups = engine_model, engine_groups
        self.device = train_groups.device
        engine_names = {key[len(MODEL):] for key in model_entries([engine_model], engine_groups.tp).entries
                        if key.startswith(MODEL)}
        extra = sorted(set(self._tensors().names) - engine_names)
        if extra:  # the engine would generate from weights the trainer does not use
            raise ValueError(f"weight refresh: the trainer has {len(extra)} tensor(s) the engine's model has not "
                             f"({', '.join(extra[:3])}...): the engine's model is not the policy's")

    def _tensors(self) -> FullTensors:
        return FullTensors(self.chunks, self.train_groups, self.vocab_size, self.optimizer, merge_lora=True)

    def refresh(self) -> float:
        """Copy the trainer's current weights into the engine's model; the seconds it took."""
        start = time.perf_counter()
        load_model_weights(_Gathered(self._tensors()), [self.engine_model], self.engine_groups)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start


class _Gathered:
    """The trainer's weights as a source of global tensors, gathered as they are asked for."""

    def __init__(self, tensors: FullTensors):
        self.tensors = tensors

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors.layout:
            raise ValueError(f"weight refresh: the engine's model has {name}, which the trainer's has not")
        return self.tensors[name]
