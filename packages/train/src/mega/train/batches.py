"""Micro-batches of one data-parallel rank: samples in the sampler's order, stacked into tensors.

Each micro-batch is a dict of the fields the model family reads (``batch_keys``) that the
samples have: integer fields (``tokens``, ``labels``, ``position_ids``, ``token_types``...) as
int64 and the rest (``loss_mask``, ``padding_mask``...) as float32, each ``[micro_batch, ...]``. A
``loss_mask`` the samples lack is all ones. Every tensor-parallel rank reads the same samples (the
dataset is deterministic), so no broadcast is needed.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from mega.core.parallel import ParallelGroups
from mega.train.sampler import cyclic_indices, single_pass_indices


class MicroBatches:
    def __init__(self, dataset, run, groups: ParallelGroups, consumed_samples: int, device: torch.device,
                 keys: tuple[str, ...] = ("tokens", "labels", "loss_mask"), optional: tuple[str, ...] = ()):
        """``keys``: the fields every micro-batch must have; ``optional``: taken when the samples have them."""
        self.dataset, self.device, self.keys, self.optional = dataset, device, keys, optional
        mbs, dp = run.training.micro_batch_size, groups.dp
        if run.data.dataloader_type == "cyclic":
            self.indices = cyclic_indices(len(dataset), consumed_samples, mbs, dp.rank, dp.size, run.training.seed)
        else:
            self.indices = single_pass_indices(len(dataset), consumed_samples, mbs, dp.rank, dp.size)

    def __iter__(self) -> Iterator:
        for indices in self.indices:
            samples = [self.dataset[i] for i in indices]
            batch = {key: self._stack(samples, key) for key in (*self.keys, *self.optional) if key in samples[0]}
            if "loss_mask" in self.keys and "loss_mask" not in batch:
                batch["loss_mask"] = torch.ones(batch["labels"].shape, dtype=torch.float32, device=self.device)
            missing = [key for key in self.keys if key not in batch]
            if missing:
                raise KeyError(f"the dataset's samples lack {', '.join(missing)}, which the model family reads")
            yield batch

    def _stack(self, samples: list, key: str) -> torch.Tensor:
        array = np.stack([np.asarray(sample[key]) for sample in samples])
        dtype = torch.long if np.issubdtype(array.dtype, np.integer) or array.dtype == bool else torch.float32
        if key.endswith("mask"):
            dtype = torch.float32
        return torch.from_numpy(array).to(device=self.device, dtype=dtype)
