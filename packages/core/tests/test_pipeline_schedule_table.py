"""The schedule table and the exchanges derived from it, computed without any model or process."""

from __future__ import annotations

import sys
from fractions import Fraction
from pathlib import Path

import pytest

from mega.core.pipeline import ScheduleError, ScheduleTable, check_exchanges, schedule_table
from mega.core.pipeline.schedule_table import BACKWARD, FORWARD, WEIGHT, Action
from mega.core.pipeline.zero_bubble import live_limits, max_deferred_weight_grads

sys.path.insert(0, str(Path(__file__).parent))  # the timeline is a test-support module beside this file
from schedule_timeline import bubble_fraction, in_flight, timeline_text  # noqa: E402

ONE_F_ONE_B = [(pp, m) for pp in range(1, 7) for m in range(1, 13)]
INTERLEAVED = [(pp, v, m) for pp in (2, 3, 4) for v in (2, 3) for m in range(pp, 4 * pp + 1, pp)]


@pytest.mark.parametrize("costs", [(1, 1), (1, 2)])
def test_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(costs):
    for pp, m in ONE_F_ONE_B:
        bubble = bubble_fraction(schedule_table(pp, m), *costs)
        assert bubble == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12), (pp, m)


def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1():
    for pp, v, m in INTERLEAVED:
        bubble = bubble_fraction(schedule_table(pp, m, vpp=v))
        assert bubble == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12), (pp, v, m)


def test_1f1b_holds_at_most_pp_minus_rank_microbatches():
    for pp, m in ONE_F_ONE_B:
        table = schedule_table(pp, m)
        assert [in_flight(table, rank) for rank in range(pp)] == [min(pp - rank, m) for rank in range(pp)]


def test_every_rank_runs_each_forward_then_its_backward_once():
    for pp, v, m in [(1, 1, 3), (4, 1, 6)] + INTERLEAVED:
        table = schedule_table(pp, m, vpp=v)
        for actions in table.actions:
            expected = {(mb, c) for mb in range(m) for c in range(v)}
            forwards = [(a.microbatch, a.chunk) for a in actions if a.kind == FORWARD]
            backwards = [(a.microbatch, a.chunk) for a in actions if a.kind == BACKWARD]
            assert sorted(forwards) == sorted(expected) and sorted(backwards) == sorted(expected)
            for item in expected:
                assert actions.index(Action(FORWARD, *item)) < actions.index(Action(BACKWARD, *item))


def test_no_pipelining_is_gradient_accumulation_and_forward_only_has_no_backward():
    assert [str(a) for a in schedule_table(1, 3).actions[0]] == ["F0 c0", "B0 c0", "F1 c0", "B1 c0", "F2 c0", "B2 c0"]
    table = schedule_table(2, 4, vpp=2, forward_only=True)
    assert all(a.kind == FORWARD for actions in table.actions for a in actions)
    assert [str(a) for a in table.actions[1]][:5] == ["F0 c0", "F1 c0", "F0 c1", "F1 c1", "F2 c0"]


def test_unit_cost_timeline_of_two_stages():
    assert timeline_text(schedule_table(2, 2)) == (
        "rank 0: F0 c0 F1 c0 ..... B0 c0 ..... B1 c0\n"
        "rank 1: ..... F0 c0 B0 c0 F1 c0 B1 c0 ....."
    )
    assert bubble_fraction(schedule_table(2, 2)) == pytest.approx(float(Fraction(1, 3)))


def megatron_order(pp, rank, v, m):
    """The order megatron-core's schedules run, rebuilt from its own helper functions."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    communicator = SimpleNamespace(
        pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: rank),
        virtual_pipeline_model_parallel_size=v if v > 1 else None,
    )
    total, _, warmup, remaining = get_pp_rank_microbatches(m, v, pp, p2p_communicator=communicator)
    table = get_schedule_table(m, v, pp)

    def action(kind, k):
        microbatch, chunk = table[k]
        return f"{kind}{microbatch} c{chunk if kind == 'F' else v - 1 - chunk}"

    order = [action("F", k) for k in range(warmup)]
    for k in range(remaining):
        order += [action("F", k + warmup), action("B", k)]
    return order + [action("B", k) for k in range(remaining, total)]


def test_order_matches_megatron_core():
    for pp, v, m in [(2, 1, 5), (4, 1, 3), (4, 1, 8)] + INTERLEAVED:
        table = schedule_table(pp, m, vpp=v)
        for rank in range(pp):
            assert [str(a) for a in table.actions[rank]] == megatron_order(pp, rank, v, m), (pp, v, m, rank)


def test_exchanges_never_deadlock_and_always_match():
    for pp in range(1, 9):
        for v in range(1, 5) if pp > 1 else [1]:
            for m in range(pp if v > 1 else 1, 3 * pp + 2, pp if v > 1 else 1):
                for forward_only in (False, True):
                    check_exchanges(schedule_table(pp, m, vpp=v, forward_only=forward_only))


def test_the_exchange_check_catches_deadlocks_and_crossed_messages():
    # Interleaving with one exchange per action (no forward-backward pairs) deadlocks: the
    # stages form a ring and every rank waits to send to the one before it.
    table = schedule_table(4, 8, vpp=2)
    per_action = tuple(tuple((a,) for a in actions) for actions in table.actions)
    with pytest.raises(ScheduleError, match="deadlock"):
        check_exchanges(ScheduleTable(4, 2, 8, per_action))
    # Rank 1 taking micro-batches in another order than rank 0 sends them would swap the data.
    f = [Action(FORWARD, mb, 0) for mb in range(2)]
    with pytest.raises(ScheduleError, match="would receive"):
        check_exchanges(ScheduleTable(2, 1, 2, (((f[0],), (f[1],)), ((f[1],), (f[0],)))))


def test_bad_numbers_are_named():
    with pytest.raises(ScheduleError, match="multiple of pp = 4, got 6"):
        schedule_table(4, 6, vpp=2)
    with pytest.raises(ScheduleError, match="needs pp > 1"):
        schedule_table(1, 4, vpp=2)
    with pytest.raises(ScheduleError, match="num_microbatches must be a positive integer, got 0"):
        schedule_table(2, 0)


ZERO_BUBBLE = [(pp, m) for pp in range(1, 7) for m in range(1, 13)]
# (schedule, vpp): ZB-H1, interleaved zero bubble, ZB-V, DualPipeV
SPLIT = [("zb-h1", 1), ("zb-h1", 2), ("zb-h1", 3), ("zbv", 2), ("dualpipev", 2)]
SPLIT_SIZES = [(pp, m) for pp in range(2, 9) for m in range(pp, 4 * pp + 1, pp)]


def held(table, rank, up, down):
    """Most actions of kind ``up`` not yet followed by their ``down`` on ``rank``."""
    count = peak = 0
    for action in table.actions[rank]:
        count += 1 if action.kind == up else -1 if action.kind == down else 0
        peak = max(peak, count)
    return peak


def test_zb_h1_bubble_is_p_minus_1_over_3m_plus_p_minus_1():
    # T_F = T_B = T_W: ZB-H1 idles pp - 1 slots where 1F1B (backward = B + W) idles 3 (pp - 1).
    for pp, m in ZERO_BUBBLE:
        if m >= pp:
            bubble = bubble_fraction(schedule_table(pp, m, schedule="zb-h1"))
            assert bubble == pytest.approx((pp - 1) / (3 * m + pp - 1), abs=1e-12), (pp, m)
    zb, one_f_one_b = bubble_fraction(schedule_table(4, 8, schedule="zb-h1")), bubble_fraction(schedule_table(4, 8), 1, 2)
    assert one_f_one_b == pytest.approx(3 / 11) and zb == pytest.approx(1 / 9)
    assert zb / one_f_one_b == pytest.approx(11 / 27)  # 41% of 1F1B's at pp4 with 8 micro-batches


@pytest.mark.parametrize(("schedule", "vpp", "versus_1f1b"), [
    ("zb-h1", 1, 0.5), ("zb-h1", 2, 0.8), ("zb-h1", 3, 0.8), ("zbv", 2, 0.42), ("dualpipev", 2, 0.42)])
def test_zero_bubble_schedules_keep_their_memory_and_beat_1f1b(schedule, vpp, versus_1f1b):
    """Live chunks (forward run, B not yet) within the stated limit, W held back within its
    bound, the bubble at most ``versus_1f1b`` of (interleaved) 1F1B's and no more than ZB-H1's."""
    for pp, m in SPLIT_SIZES:
        table = schedule_table(pp, m, vpp, schedule=schedule)
        limits = live_limits(schedule, pp, vpp)
        for rank in range(pp):
            assert held(table, rank, FORWARD, BACKWARD) <= limits[rank], (schedule, vpp, pp, m, rank)
            assert held(table, rank, BACKWARD, WEIGHT) <= max_deferred_weight_grads(schedule, pp)
        bubble = bubble_fraction(table)
        one_f_one_b = bubble_fraction(schedule_table(pp, m, vpp), 1, 2)
        assert bubble <= versus_1f1b * one_f_one_b + 1e-12, (schedule, vpp, pp, m)
        assert bubble <= bubble_fraction(schedule_table(pp, m, schedule="zb-h1")) + 1e-12, (schedule, vpp, pp, m)
    # The limits themselves: 1F1B's pp - rank, interleaved 1F1B's, 1F1B's first-rank peak in chunks.
    assert live_limits("zb-h1", 4, 1) == [min(4 - rank, 8) for rank in range(4)] == [
        in_flight(schedule_table(4, 8), rank) for rank in range(4)]
    assert live_limits("zb-h1", 4, 2) == [in_flight(schedule_table(4, 8, vpp=2), rank) for rank in range(4)]
    assert live_limits("zbv", 4, 2) == [8] * 4 and live_limits("dualpipev", 4, 2) == [10] * 4


def test_zb_h1_holds_what_1f1b_holds():
    # Up to B: 1F1B's pp - rank on every rank. Up to W (a pending W still holds its layers'
    # inputs): at most 1F1B's peak, pp micro-batches on its first rank (the paper's accounting).
    for pp, m in ZERO_BUBBLE:
        table = schedule_table(pp, m, schedule="zb-h1")
        assert [held(table, rank, FORWARD, BACKWARD) for rank in range(pp)] == [min(pp - rank, m) for rank in range(pp)]
        assert max(in_flight(table, rank) for rank in range(pp)) == max(
            in_flight(schedule_table(pp, m), rank) for rank in range(pp)) == min(pp, m), (pp, m)


@pytest.mark.parametrize(("schedule", "vpp"), SPLIT)
def test_split_schedules_run_every_f_b_w_once_in_order_and_their_exchanges_meet(schedule, vpp):
    for pp in range(2, 7):
        for m in range(1, 3 * pp + 1):
            if schedule == "zb-h1" and vpp > 1 and m % pp:
                continue
            table = schedule_table(pp, m, vpp, schedule=schedule)
            check_exchanges(table)
            check_exchanges(schedule_table(pp, m, vpp, forward_only=True, schedule=schedule))
            for actions in table.actions:
                for mb in range(m):
                    for chunk in range(vpp):
                        f, b, w = (actions.index(Action(kind, mb, chunk)) for kind in (FORWARD, BACKWARD, WEIGHT))
                        assert f < b < w
                assert len(actions) == 3 * m * vpp


def test_v_placement_puts_the_first_and_the_last_stage_on_the_first_rank():
    table = schedule_table(4, 4, 2, schedule="zbv")
    assert [[table.stage(rank, chunk) for chunk in range(2)] for rank in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert all(table.rank_and_chunk(table.stage(rank, chunk)) == (rank, chunk) for rank in range(4) for chunk in range(2))


def test_zb_h1_timeline_of_two_stages():
    assert timeline_text(schedule_table(2, 2, schedule="zb-h1")) == (
        "rank 0: F0 c0 F1 c0 ..... B0 c0 W0 c0 B1 c0 W1 c0\n"  # W0 fills the wait for B1's gradient
        "rank 1: ..... F0 c0 B0 c0 F1 c0 B1 c0 W0 c0 W1 c0"
    )


def test_dualpipev_spends_its_larger_memory_on_a_bubble_no_larger_than_zbv():
    for pp in range(2, 7):
        for m in range(1, 3 * pp + 1):
            dualpipev, zbv = (bubble_fraction(schedule_table(pp, m, 2, schedule=name)) for name in ("dualpipev", "zbv"))
            assert dualpipev <= zbv + 1e-12, (pp, m)
