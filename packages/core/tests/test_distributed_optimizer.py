"""The ZeRO-1 distributed optimizer against plain AdamW on one process (fp32, gloo)."""

from __future__ import annotations

import pytest
import torch

from mega.core.distributed import DDPConfig
from mega.core.optim import OptimizerConfig
from mega.core.parallel import ParallelConfig
from mega.testing.equivalence import assert_matches, reference_train, train_tiny_lm

STEPS = 3
# clip_grad is small enough that every step clips: the norm over shards must be the global one.
OPTIMIZER = OptimizerConfig(lr=1e-3, clip_grad=0.05, use_distributed_optimizer=True)
DDP = DDPConfig(bucket_size=3000, use_distributed_optimizer=True, overlap_grad_reduce=True)


@pytest.fixture(scope="module")
def reference():
    return reference_train(steps=STEPS, optimizer=OPTIMIZER)


def train(layout, overlap_param_gather, micro_batches):
    optimizer = OptimizerConfig(**{**vars(OPTIMIZER), "overlap_param_gather": overlap_param_gather})
    return train_tiny_lm(layout, steps=STEPS, ddp=DDP, optimizer=optimizer, micro_batches=micro_batches)


CASES = {
    # name: (world, layout, overlap_param_gather, micro-batches)
    "dp2, overlapped param gather": (2, ParallelConfig(), True, 2),
    "dp4": (4, ParallelConfig(), False, 1),
    "tp2 x dp2, sequence parallel, overlapped param gather": (
        4, ParallelConfig(tp=2, sequence_parallel=True), True, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_distributed_optimizer_matches_adamw(worlds, reference, case):
    world, layout, overlap, micro_batches = CASES[case]
    assert all(norm > OPTIMIZER.clip_grad for norm in reference.grad_norms)  # clipping is active
    for result in worlds.run(world, train, layout, overlap, micro_batches):
        assert result.first_grads is None  # sharded: only parameters and norms can be compared
        assert_matches(result, reference)


def optimizer_state_bytes():
    from mega.testing.tiny_lm import TinyConfig

    config = TinyConfig(hidden=64, ffn=128)
    result = train_tiny_lm(steps=1, ddp=DDPConfig(bucket_size=5000, use_distributed_optimizer=True),
                           optimizer=OPTIMIZER, config=config)
    return result.state_bytes


def test_optimizer_state_per_rank_falls_as_one_over_dp(worlds):
    single = optimizer_state_bytes()  # this process: dp = 1
    from mega.testing.tiny_lm import TinyConfig, TinyLM

    params = sum(p.numel() for p in TinyLM(TinyConfig(hidden=64, ffn=128)).parameters())
    assert single == 8 * params  # fp32 params are their own main params: Adam's two moments remain
    for dp in (2, 4):
        per_rank = worlds.run(dp, optimizer_state_bytes)
        assert sum(per_rank) == single  # every element owned exactly once
        assert max(per_rank) <= single / dp + 8 * 128 * dp * 4  # up to bucket padding


def test_distributed_optimizer_needs_sharded_ddp_buffers():
    from mega.core.distributed import DistributedDataParallel
    from mega.core.optim import build_optimizer
    from mega.core.parallel import ParallelGroups

    groups = ParallelGroups(ParallelConfig())
    model = DistributedDataParallel(torch.nn.Linear(4, 4), groups, DDPConfig())
    with pytest.raises(ValueError, match="use_distributed_optimizer=True"):
        build_optimizer([model], groups, OPTIMIZER)
    with pytest.raises(ValueError, match="every model chunk wrapped in DistributedDataParallel"):
        build_optimizer([torch.nn.Linear(4, 4)], groups, OPTIMIZER)


def test_a_weight_tied_across_stages_gets_a_bucket_of_its_own():
    from torch import nn

    from mega.core.distributed import DistributedDataParallel
    from mega.core.parallel import ParallelGroups

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight.shared_embedding = True
    groups = ParallelGroups(ParallelConfig())
    sharded = DistributedDataParallel(model, groups, DDPConfig(bucket_size=None, use_distributed_optimizer=True))
    buckets = [bucket.params for buffer in sharded.grad_buffers for bucket in buffer.buckets]
    assert [model[1].weight] in buckets and len(buckets) == 3
    assert all(bucket.numel % 128 == 0 for buffer in sharded.grad_buffers for bucket in buffer.buckets)
