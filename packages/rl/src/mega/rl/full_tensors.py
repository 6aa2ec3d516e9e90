"""The full tensors of a training run's model under mega's global names, gathered from any layout.

What one process would hold, whatever tp, pp, ep and FSDP2 split: each name's full tensor is
assembled on the pipeline stage that holds it and then broadcast over the pipeline group, so every
rank receives the same tensor, one name at a time (the memory of the largest tensor, never the
whole model). Gathering on a stage undoes its splits in turn:

* FSDP2: a DTensor parameter's shards over the data-parallel mesh (``full_tensor()``);
* tensor parallelism: the shards concatenated along ``partition_dim``, block by block where a
  parameter is ``partition_chunks`` blocks split on their own (SwiGLU's ``[gate; up]``), over the
  experts' own tensor group where they have one;
* expert parallelism: each rank's whole experts stacked along dimension 0;
* pipeline parallelism: names are global already (layer ``N`` is ``decoder.layers.N`` on whichever
  stage holds it); the lowest pipeline rank that holds a name sends it (a tied embedding's copy on
  the last stage is the same tensor).

A padded vocabulary (``--make-vocab-size-divisible-by`` times tp) is cut to ``vocab_size`` rows:
the padding belongs to the layout, so the tensors are the same at every layout, and a reader pads
them again for its own. Names are canonical (:mod:`mega.core.parameter_names`).

With ``merge_lora`` a LoRA policy's tensors are those of the model it computes: each adapted
layer's weight comes merged (``W + B A * alpha / rank``, :func:`~mega.models.lora.adapters.merged_weight`,
from the full ``W``, ``A`` and ``B``) and the adapters' own tensors are left out, so a reader with
no adapters (an engine of its own layout, a Hugging Face model) generates what the policy does.

Every rank of the world must walk the names in the same order (each call is a collective);
:func:`full_named_tensors` walks all of them in pipeline order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from mega.core.parallel.collectives import gather_along
from mega.core.parallel.groups import ParallelGroups
from mega.core.parallel.layers import gather_shards
from mega.core.parallel.param_attrs import expert_shard, is_padded_vocab
from mega.core.parallel.pieces import TensorParallelSplit
from mega.models.lora.adapters import merged_weight

# A LoRA layer's adapter tensors beside its base weight ``<layer>.weight`` (mega.models.lora.adapters).
ADAPTER_IN, ADAPTER_OUT, ADAPTER_SCALING = ".adapter.linear_in.weight", ".adapter.linear_out.weight", ".adapter.scaling"


class FullTensors:
    """The full tensors of a rank's model chunks by canonical name (a collective per name)."""

    def __init__(self, chunks: list[nn.Module], groups: ParallelGroups, vocab_size: int, optimizer=None,
                 merge_lora: bool = False):
        # Start-up cost: the checkpoint's module imports torch.distributed.checkpoint (a third of a
        # second); an engine that never gathers does not pay it.
        from mega.core.checkpoint.state import named_parameters, settle

        settle(chunks, optimizer)  # parameter all-gathers finished, FSDP units resharded: the parameters by name
        self.groups, self.vocab_size = groups, vocab_size
        self.params, _ = named_parameters(chunks)
        # base weight name -> (A's name, B's name, alpha / rank) of each adapted layer on this stage
        self.adapters: dict[str, tuple[str, str, float]] = {}
        if merge_lora:
            buffers, _ = named_parameters(chunks, buffers=True)
            for name in self.params:
                if name.endswith(ADAPTER_IN):
                    layer = name[: -len(ADAPTER_IN)]
                    self.adapters[f"{layer}.weight"] = (name, layer + ADAPTER_OUT, float(buffers[layer + ADAPTER_SCALING]))
        hidden = {name for pair in self.adapters.values() for name in pair[:2]}
        held = {name: (self._full_shape(param), param.dtype) for name, param in self.params.items()
                if name not in hidden}
        by_stage = [held]
        if groups.pp.size > 1:
            by_stage = [None] * groups.pp.size
            dist.all_gather_object(by_stage, held, group=groups.pp.group)
        # name -> (pipeline rank that sends it, full shape, dtype), in pipeline order
        self.layout: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        for stage, names in enumerate(by_stage):
            for name, (shape, dtype) in names.items():
                self.layout.setdefault(name, (stage, shape, dtype))

    @property
    def names(self) -> list[str]:
        return list(self.layout)

    def _full_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        split = TensorParallelSplit.of(param, self.groups.tp.rank, self.groups.tp.size)
        shape = split.global_shape(tuple(param.shape))  # (a DTensor's shape is its tp shard's already)
        if is_padded_vocab(param):
            shape = (self.vocab_size, *shape[1:])
        return shape

    def _gathered_here(self, param: nn.Parameter) -> torch.Tensor:
        """The full tensor from this stage's shards (collectives within the stage)."""
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):  # an FSDP2 shard (DTensor) over the data-parallel mesh
            tensor = tensor.full_tensor()
        split = TensorParallelSplit.of(param, self.groups.tp.rank, self.groups.tp.size)
        if split.dim is not None:
            group = self.groups.etp if hasattr(param, "expert_tensor_shard") else self.groups.tp
            tensor = gather_shards(tensor, group, split.dim, split.chunks)
        if expert_shard(param)[1] > 1:
            tensor = gather_along(tensor, self.groups.ep, 0)
        if is_padded_vocab(param):
            tensor = tensor[:self.vocab_size]
        return tensor.contiguous()

    def __getitem__(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` on every rank: a collective every rank calls in one order."""
        if name not in self.layout:
            raise KeyError(f"the model has no parameter {name!r}")
        sender, shape, dtype = self.layout[name]
        pp = self.groups.pp
        if pp.rank == sender:
            tensor = self._gathered_here(self.params[name])
            if name in self.adapters:
                a, b, scaling = self.adapters[name]
                tensor = merged_weight(tensor, self._gathered_here(self.params[a]),
                                       self._gathered_here(self.params[b]), scaling)
        else:
            tensor = torch.empty(shape, dtype=dtype, device=self.groups.device)
        if pp.size > 1:
            dist.broadcast(tensor, src=pp.ranks[sender], group=pp.group)
        return tensor


def full_named_tensors(trainer) -> Iterator[tuple[str, torch.Tensor]]:
    """(mega name, full tensor) for every parameter of ``trainer``'s model (a
    :class:`mega.train.trainer.Trainer`), in pipeline order, the same on every rank."""
    tensors = FullTensors(trainer.chunks, trainer.groups, trainer.run.model.vocab_size, trainer.optimizer)
    for name in tensors.names:
        yield name, tensors[name]
