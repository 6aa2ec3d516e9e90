"""Data parallelism (alone and with tensor/sequence parallelism) against one process, fp32 on gloo."""

from __future__ import annotations

import pytest
import torch

from mega.core.distributed import DDPConfig
from mega.core.optim import OptimizerConfig
from mega.core.parallel import ParallelConfig
from mega.testing.equivalence import assert_matches, reference_train, train_tiny_lm

STEPS = 3
OPTIMIZER = OptimizerConfig(lr=1e-3, clip_grad=1.0)


@pytest.fixture(scope="module")
def reference():
    return reference_train(steps=STEPS, optimizer=OPTIMIZER)


def train(layout, ddp, micro_batches):
    return train_tiny_lm(layout, steps=STEPS, micro_batches=micro_batches, ddp=ddp, optimizer=OPTIMIZER)


CASES = {
    # name: (world, layout, ddp config, micro-batches)
    "dp2, overlapped small buckets, 2 micro-batches": (
        2, ParallelConfig(), DDPConfig(bucket_size=1000, overlap_grad_reduce=True), 2),
    "dp4, fp32 reduction, one bucket": (4, ParallelConfig(), DDPConfig(bucket_size=None, grad_reduce_in_fp32=True), 1),
    "tp2 x dp2, sequence parallel, overlapped": (
        4, ParallelConfig(tp=2, sequence_parallel=True), DDPConfig(bucket_size=3000, overlap_grad_reduce=True), 2),
    "tp2 x dp2": (4, ParallelConfig(tp=2), DDPConfig(bucket_size=3000), 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_data_parallel_training_matches_one_process(worlds, reference, case):
    world, layout, ddp, micro_batches = CASES[case]
    for result in worlds.run(world, train, layout, ddp, micro_batches):
        assert_matches(result, reference)


def overlap_and_no_sync_check():
    from mega.core.distributed import DistributedDataParallel
    from mega.core.parallel import CommCounter, ParallelGroups, apply_tensor_parallel
    from mega.core.plugins.events import Events
    from mega.core.plugins.hookspecs import hookimpl
    from mega.testing.tiny_lm import PLAN, TinyConfig, TinyLM, make_batch

    class Listener:
        def __init__(self):
            self.seen = []

        @hookimpl
        def on_grad_sync_start(self):
            self.seen.append("start")

        @hookimpl
        def on_grad_sync_end(self):
            self.seen.append("end")

    listener = Listener()
    groups = ParallelGroups(ParallelConfig())
    torch.manual_seed(0)
    model = apply_tensor_parallel(TinyLM(TinyConfig()), PLAN, groups)
    ddp = DistributedDataParallel(model, groups, DDPConfig(bucket_size=1000, overlap_grad_reduce=True),
                                  events=Events([listener]))
    tokens, labels = make_batch(TinyConfig(), 2, groups.global_rank)
    with CommCounter() as accumulating, ddp.no_sync():
        ddp(tokens, labels, groups.tp).backward()
    with CommCounter() as last_backward:
        ddp(tokens, labels, groups.tp).backward()
    with CommCounter() as finishing:
        ddp.finish_grad_sync()
    buckets = [bucket.numel for buffer in ddp.grad_buffers for bucket in buffer.buckets]
    error = None
    try:  # a second backward without no_sync into buckets already reduced is a schedule bug
        ddp(tokens, labels, groups.tp).backward()
        ddp(tokens, labels, groups.tp).backward()
    except RuntimeError as caught:
        error = str(caught)
    return accumulating.summary(), last_backward.summary(), finishing.summary(), buckets, listener.seen, error


def test_buckets_reduce_during_backward_and_not_under_no_sync(worlds):
    for accumulating, last_backward, finishing, buckets, seen, error in worlds.run(2, overlap_and_no_sync_check):
        assert len(buckets) > 2
        assert accumulating == {}
        # Every bucket's all-reduce started during the last backward, none waited for the end.
        assert last_backward == {"all_reduce/dp_cp": {"calls": len(buckets), "elements": sum(buckets),
                                                      "bytes": 4 * sum(buckets)}}
        assert finishing == {}
        assert seen == ["start", "end"]
        assert "already being reduced" in error


def expert_grads_check():
    from torch import nn

    from mega.core.distributed import DistributedDataParallel
    from mega.core.optim import clip_grad_norm_
    from mega.core.parallel import ParallelGroups
    from mega.core.parallel.param_attrs import mark_expert_parallel

    groups = ParallelGroups(ParallelConfig(ep=2))  # 4 ranks: ep groups [0,1],[2,3]; expert dp [0,2],[1,3]
    model = nn.Module()
    model.dense = nn.Parameter(torch.zeros(3))
    model.expert = nn.Parameter(torch.zeros(5))
    mark_expert_parallel(model.expert)
    ddp = DistributedDataParallel(model, groups, DDPConfig())
    value = float(groups.global_rank + 1)
    ((model.dense * value).sum() + (model.expert * value).sum()).backward()
    ddp.finish_grad_sync()
    norm = clip_grad_norm_(model.parameters(), 0.0, groups)
    return model.dense.main_grad.tolist(), model.expert.main_grad.tolist(), norm


def test_expert_gradients_reduce_over_expert_data_parallel_ranks(worlds):
    results = worlds.run(4, expert_grads_check)
    expert_means = {0: (1 + 3) / 4, 1: (2 + 4) / 4}  # summed over expert-dp peers, scaled by 1/dp
    for rank, (dense, expert, norm) in enumerate(results):
        assert dense == [2.5] * 3  # the mean of 1, 2, 3, 4 over all four data-parallel ranks
        assert expert == [expert_means[rank % 2]] * 5
        # Each distinct element once: the dense vector once, each expert-parallel rank's expert once.
        assert norm == pytest.approx((3 * 2.5**2 + 5 * 1.0**2 + 5 * 1.5**2) ** 0.5)
