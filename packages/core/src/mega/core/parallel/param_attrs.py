"""How a parameter is split across ranks, recorded as attributes on the parameter itself.

The parallel layers and :func:`~mega.core.parallel.tensor_parallel.apply_tensor_parallel` set
them; gradient reduction, clipping and checkpoints read them. The names follow Megatron-Core's
where it has one, so readers of either code base recognise them.

* ``tensor_model_parallel`` (bool), ``partition_dim`` (int), ``partition_chunks`` (int): the
  parameter is this rank's shard of a larger one, split along ``partition_dim`` over the tensor
  group; with ``partition_chunks`` > 1 the full tensor is that many blocks (SwiGLU's gate and up)
  each split on its own.
* ``sequence_parallel`` (bool): replicated over the tensor group but computed on sequence shards,
  so its gradient is summed over the tensor group (norm weights under sequence parallelism).
* ``expert_parallel`` (bool): belongs to an expert; sharded over the expert group, replicated
  (and gradient-averaged) over the expert data-parallel group.
* ``expert_shard`` ((int, int)): (expert-parallel rank, size) of a grouped expert weight whose
  dimension 0 is the experts: this rank holds experts ``rank * n`` .. ``(rank + 1) * n - 1`` of
  ``size * n``, so checkpoints and initialisation place it in the global tensor.
* ``expert_tensor_shard`` ((int, int)): (rank, size) in the experts' own tensor group
  (``--expert-tensor-parallel-size``) of an expert weight's tensor-parallel split, where that
  group is not the tensor group.
* ``shared_embedding`` (bool): a weight tied across pipeline stages (set on both copies by
  :func:`mega.core.pipeline.tied.tie_across_stages`); with the distributed optimizer it gets a
  bucket of its own, so both stages shard it alike and the cross-stage gradient sum after the
  data-parallel reduce-scatter is right on every owned slice.
* ``padded_vocab`` (bool): dimension 0 is the vocabulary, padded as the layout pads it
  (``--make-vocab-size-divisible-by`` x tp), so its global size differs between layouts;
  checkpoints load the rows two layouts share and zero the rest.
* ``checkpoint_optional`` (bool): added to a model after it was built (LoRA adapters): loaded
  where a checkpoint has it, left as initialised where it does not (a base model's checkpoint).
* ``shared`` (bool): a copy of a parameter another pipeline stage owns (tied word embeddings on
  the last stage); its gradient is synchronised with the owner's and it is not counted twice.
"""

from __future__ import annotations

import torch


def mark_tensor_parallel(param: torch.Tensor, dim: int, chunks: int = 1) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_chunks = chunks


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return getattr(param, "tensor_model_parallel", False)


def mark_sequence_parallel(param: torch.Tensor) -> None:
    param.sequence_parallel = True


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return getattr(param, "sequence_parallel", False)


def mark_expert_parallel(param: torch.Tensor) -> None:
    param.expert_parallel = True


def is_expert_parallel(param: torch.Tensor) -> bool:
    return getattr(param, "expert_parallel", False)


def mark_expert_shard(param: torch.Tensor, rank: int, size: int) -> None:
    """``param``'s dimension 0 is this rank's block of the experts (see the module docstring)."""
    param.expert_parallel = True
    param.expert_shard = (rank, size)


def expert_shard(param: torch.Tensor) -> tuple[int, int]:
    return getattr(param, "expert_shard", (0, 1))


def mark_expert_tensor_shard(param: torch.Tensor, rank: int, size: int) -> None:
    param.expert_tensor_shard = (rank, size)


def tensor_shard(param: torch.Tensor, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(rank, size) of ``param``'s tensor-parallel split: the experts' own group's where they
    have one, else the tensor group's ``tp_rank``, ``tp_size``."""
    return getattr(param, "expert_tensor_shard", (tp_rank, tp_size))


def mark_padded_vocab(param: torch.Tensor) -> None:
    param.padded_vocab = True


def is_padded_vocab(param: torch.Tensor) -> bool:
    return getattr(param, "padded_vocab", False)


def is_shared_copy(param: torch.Tensor) -> bool:
    return getattr(param, "shared", False)


def is_shared_embedding(param: torch.Tensor) -> bool:
    return getattr(param, "shared_embedding", False)


def mark_checkpoint_optional(param: torch.Tensor) -> None:
    param.checkpoint_optional = True


def is_checkpoint_optional(param: torch.Tensor) -> bool:
    return getattr(param, "checkpoint_optional", False)
