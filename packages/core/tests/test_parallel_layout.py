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
    ],
)
def test_bad_layouts_fail_with_the_numbers(config, world, message):
    with pytest.raises(ParallelConfigError, match=message):
        config.validate(world)


def test_data_parallel_size_is_derived():
    assert ParallelConfig(tp=2, pp=2).data_parallel_size(16) == 4
    assert ParallelConfig(tp=2, cp=2, ep=4).data_parallel_size(16) == 4
