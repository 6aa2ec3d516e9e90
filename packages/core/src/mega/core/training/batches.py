"""Micro-batches of one data-parallel rank: samples in the sampler's order, stacked into tensors.

Each micro-batch is ``(tokens, (labels, loss_mask))`` with ``tokens``/``labels`` ``[micro_batch,
seq]`` int64 and ``loss_mask`` float, the form the schedules pass to the first stage and to the
loss. Every tensor-parallel rank reads the same samples (the dataset is deterministic), so no
broadcast is needed.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from mega.core.parallel import ParallelGroups
from mega.core.training.sampler import cyclic_indices, single_pass_indices


class MicroBatches:
    def __init__(self, dataset, run, groups: ParallelGroups, consumed_samples: int, device: torch.device):
        self.dataset, self.device = dataset, device
        mbs, dp = run.training.micro_batch_size, groups.dp
        if run.data.dataloader_type == "cyclic":
            self.indices = cyclic_indices(len(dataset), consumed_samples, mbs, dp.rank, dp.size, run.training.seed)
        else:
            self.indices = single_pass_indices(len(dataset), consumed_samples, mbs, dp.rank, dp.size)

    def __iter__(self) -> Iterator:
        for indices in self.indices:
            samples = [self.dataset[i] for i in indices]
            tokens = self._stack(samples, "tokens", torch.long)
            labels = self._stack(samples, "labels", torch.long)
            if "loss_mask" in samples[0]:
                loss_mask = self._stack(samples, "loss_mask", torch.float32)
            else:
                loss_mask = torch.ones(labels.shape, dtype=torch.float32, device=self.device)
            yield tokens, (labels, loss_mask)

    def _stack(self, samples: list, key: str, dtype: torch.dtype) -> torch.Tensor:
        array = np.stack([np.asarray(sample[key]) for sample in samples])
        return torch.from_numpy(array).to(device=self.device, dtype=dtype)
