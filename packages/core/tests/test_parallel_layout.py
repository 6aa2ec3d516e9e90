"""Rank layout and config validation, checked against megatron-core's RankGenerator."""

from __future__ import annotations

import itertools

import pytest

from mega.core.parallel import ParallelConfig, ParallelConfigError, rank_groups
from mega.core.parallel.layout import embedding_ranks


def test_documented_example_world16_tp2_pp2():
    sizes = {"tp": 2, "dp": 4, "pp": 2}
    assert rank_groups(sizes, "tp")[:2] == [[0, 1], [2, 3]]
    assert rank_groups(sizes, "dp")[:3] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14]]
    assert rank_groups(sizes, "pp")[:2] == [[0, 8], [1, 9]]
    assert embedding_ranks([1, 5, 9, 13]) == [1, 13]
    assert embedding_ranks([3]) == [3]


@pytest.mark.parametrize(
    "tp,cp,dp,pp", [t for t in itertools.product([1, 2], [1, 2], [1, 2, 4], [1, 2, 3]) if t != (1, 1, 1, 1)]
)
def test_groups_match_megatron_core(tp, cp, dp, pp):
    from megatron.core.parallel_state import RankGenerator

    reference = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    for dims in ["tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-cp", "tp-dp-pp", "tp-cp-dp-pp"]:
        assert rank_groups(sizes, dims) == reference.get_ranks(dims), dims


@pytest.mark.parametrize("tp,ep,dp,pp", [(1, 2, 2, 1), (2, 2, 1, 2), (2, 4, 1, 1), (1, 2, 4, 2)])
def test_expert_groups_match_megatron_core(tp, ep, dp, pp):
    from megatron.core.parallel_state import RankGenerator

    reference = RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    sizes = {"tp": tp, "ep": ep, "dp": dp, "pp": pp}
    for dims in ["ep", "dp", "tp-ep", "tp-ep-pp"]:
        assert rank_groups(sizes, dims) == reference.get_ranks(dims), dims


@pytest.mark.parametrize("tp,etp,ep,pp,world", [(2, 1, 2, 1, 4), (2, 1, 4, 1, 4), (4, 2, 2, 1, 8), (4, 1, 4, 2, 16),
                                                (2, 2, 2, 1, 4)])
def test_expert_tensor_parallel_groups_match_megatron_core(tp, etp, ep, pp, world):
    """--expert-tensor-parallel-size: the etp, ep and expert data-parallel groups ParallelGroups
    builds (planning, no processes) are megatron-core's expert rank generator's."""
    from megatron.core.parallel_state import RankGenerator

    from mega.core.parallel import ParallelGroups

    config = ParallelConfig(tp=tp, etp=etp, ep=ep, pp=pp, sequence_parallel=True)
    reference = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for rank in range(world):
        groups = ParallelGroups(config, world_size=world, rank=rank)
        for ours, dims in ((groups.etp, "tp"), (groups.ep, "ep"), (groups.expert_dp, "dp")):
            theirs = next(ranks for ranks in reference.get_ranks(dims) if rank in ranks)
            assert list(ours.ranks) == theirs, (rank, dims)
        assert list(groups.tp.ranks) == next(ranks for ranks in dense.get_ranks("tp") if rank in ranks)
        assert set(groups.etp.ranks) <= set(groups.tp.ranks), "an etp group lies inside one tensor group"


def test_unknown_dimension():
    with pytest.raises(ValueError, match="unknown parallel dimension"):
        rank_groups({"tp": 2}, "tp-zz")


@pytest.mark.parametrize(
    "config,world,message",
    [
        (ParallelConfig(tp=3), 8, "world size 8 is not divisible by tp\\*cp\\*pp = 3\\*1\\*1 = 3"),
        (ParallelConfig(tp=4, pp=4), 8, "tp\\*cp\\*pp = 4\\*1\\*4 = 16 is larger than the world size 8"),
        (ParallelConfig(tp=2, ep=3), 8, "ep = 3 must divide dp\\*cp = 4\\*1 = 4"),
        (ParallelConfig(pp=1, vpp=2), 4, "vpp = 2 \\(virtual pipeline stages\\) needs pp > 1, got pp = 1"),
        (ParallelConfig(tp=0), 4, "tp must be a positive integer, got 0"),
        (ParallelConfig(tp=2, etp=4, sequence_parallel=True), 8,
         "--expert-tensor-parallel-size 4 must be a positive divisor of --tensor-model-parallel-size 2"),
        (ParallelConfig(tp=2, etp=1), 4, "--expert-tensor-parallel-size 1 differs from --tensor-model-parallel-size "
         "2: this needs --sequence-parallel"),
        (ParallelConfig(tp=2, etp=1, ep=3, sequence_parallel=True), 8,
         "ep = 3 must divide dp\\*cp\\*tp/etp = 4\\*1\\*2/1 = 8 \\(--expert-tensor-parallel-size 1\\)"),
    ],
)
def test_bad_layouts_fail_with_the_numbers(config, world, message):
    with pytest.raises(ParallelConfigError, match=message):
        config.validate(world)


def test_data_parallel_size_is_derived():
    assert ParallelConfig(tp=2, pp=2).data_parallel_size(16) == 4
    assert ParallelConfig(tp=2, cp=2, ep=4).data_parallel_size(16) == 4
