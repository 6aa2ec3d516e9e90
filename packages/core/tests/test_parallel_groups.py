"""ParallelGroups on real gloo ranks, and the multi-rank harness itself."""

from __future__ import annotations

import pytest

from mega.core.parallel import ParallelConfig, rank_groups
from mega.testing import RankFailed, WorldTimeout


def describe_groups(tp, pp):
    import torch
    import torch.distributed as dist

    from mega.core.parallel import ParallelGroups

    groups = ParallelGroups(ParallelConfig(tp=tp, pp=pp))
    # A sum over each group proves the process group really contains the ranks it claims.
    sums = {}
    for name in ("tp", "dp", "pp", "dp_cp", "embedding", "ep", "expert_dp"):
        group = getattr(groups, name)
        value = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(value, group=group.group)
        sums[name] = (group.ranks, group.rank, value.item())
    return sums, groups.pp.is_first, groups.is_pipeline_last, str(groups.device)


def test_groups_on_eight_ranks(worlds):
    results = worlds.run(8, describe_groups, 2, 2)
    sizes = {"tp": 2, "dp": 2, "pp": 2}
    for rank, (sums, first, last, device) in enumerate(results):
        for name, dims in [("tp", "tp"), ("dp", "dp"), ("pp", "pp"), ("dp_cp", "dp-cp")]:
            ranks, index, total = sums[name]
            expected = next(g for g in rank_groups(sizes, dims) if rank in g)
            assert list(ranks) == expected and ranks[index] == rank
            assert total == sum(expected)
        assert first == (rank < 4) and last == (rank >= 4)
        assert device == "cpu"


def test_single_process_groups_need_no_distributed():
    from mega.core.parallel import ParallelGroups

    groups = ParallelGroups(ParallelConfig())
    assert groups.world_size == 1 and groups.tp.size == 1 and groups.dp.group is None
    assert groups.pp.is_first and groups.is_pipeline_last


def raise_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()  # rank 0 waits for a rank that will never come
    return "unreachable"


def hang_on_rank_zero():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.barrier()
    return dist.get_rank()


def rank_and_world(offset):
    import torch.distributed as dist

    return dist.get_rank() + offset, dist.get_world_size()


def test_a_failing_rank_fails_with_its_traceback_and_the_world_recovers(worlds):
    with pytest.raises(RankFailed, match="(?s)rank 1 of 2.*ValueError: rank one is unhappy"):
        worlds.run(2, raise_on_rank_one)
    assert worlds.run(2, rank_and_world, 10) == [(10, 2), (11, 2)]


def test_a_hang_becomes_a_timeout(worlds):
    with pytest.raises(WorldTimeout, match="ranks \\[0\\] of 2 did not finish"):
        worlds.run(2, hang_on_rank_zero, timeout_s=3)
    assert worlds.run(2, rank_and_world, 0) == [(0, 2), (1, 2)]
