"""Rewards: the --reward syntax, the plugin registry, the built-ins, and the worker pool that
keeps a run going when a reward raises, hangs or returns NaN. CPU only (no tensors: the workers
are plain processes)."""

from __future__ import annotations

import math
import textwrap
import time
import types

import pytest

from mega.core.plugins import hookimpl, load_plugins
from mega.core.plugins.registry import DuplicateNameError
from mega.rl import builtin_rewards
from mega.rl.rewards import RewardPool, RewardSpecError, load_reward, load_rewards, parse_reward_spec, score

# A user's reward module, as `--reward user_rewards:NAME` imports it: written to a directory on
# sys.path so that the spawned workers import it by name as they would a user's.
USER_REWARDS = textwrap.dedent('''
    import math
    import re
    import time

    def exact(prompt, completion, answer, **fields):
        return 1.0 if completion.strip() == answer else 0.0

    def raises(prompt, completion, **fields):
        raise RuntimeError("this reward is broken")

    def sleeps(prompt, completion, **fields):
        time.sleep(60)
        return 1.0

    def backtracks(prompt, completion, **fields):
        # catastrophic backtracking: hangs inside the regex engine's C code, deaf to signals
        return float(bool(re.match(r"(a+)+$", "a" * 64 + "b")))

    def not_a_number(prompt, completion, **fields):
        return {"nan": math.nan, "inf": math.inf, "none": None, "text": "high"}.get(completion, 0.5)

    def exits(prompt, completion, **fields):
        import os
        os._exit(3)

    def batched_length(prompts, completions, answer, **kwargs):
        # TRL's kind: every column a list, one value per completion
        return [float(len(c)) + (0.5 if a == c else 0.0) for c, a in zip(completions, answer)]

    def batched_short(prompts, completions, **kwargs):
        return [1.0]
''')


@pytest.fixture(scope="module")
def user_rewards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("user_rewards")
    (directory / "user_rewards.py").write_text(USER_REWARDS)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(directory))
        yield "user_rewards"


@pytest.fixture(scope="module")
def pool(user_rewards):
    with RewardPool(workers=2, timeout=0.5) as pool:
        yield pool


def test_reward_spec_syntax():
    assert parse_reward_spec("math") == ("math", 1.0)
    assert parse_reward_spec("math:2") == ("math", 2.0)
    assert parse_reward_spec("my_pkg.rewards:brevity") == ("my_pkg.rewards:brevity", 1.0)
    assert parse_reward_spec("my_pkg.rewards:brevity:-0.5") == ("my_pkg.rewards:brevity", -0.5)
    with pytest.raises(RewardSpecError, match="finite"):
        parse_reward_spec("math:nan")


def test_rewards_by_registered_name_and_import_path(user_rewards):
    plugins = load_plugins(environ={"MEGA_LOAD_PLUGINS": "rl"})
    assert {"math", "format", "length"} <= set(plugins.rewards.names())
    reward = load_reward("math:2", plugins.rewards)
    assert reward.function is builtin_rewards.math_answer and reward.weight == 2.0 and not reward.batched
    assert load_reward("user_rewards:batched_length").batched
    with pytest.raises(RewardSpecError, match="no reward 'maths'.*did you mean math"):
        load_reward("maths", plugins.rewards)
    with pytest.raises(RewardSpecError, match="cannot import user_rewards:missing"):
        load_reward("user_rewards:missing")
    with pytest.raises(RewardSpecError, match="more than once"):
        load_rewards(["math", "math:2"], plugins.rewards)


def test_a_reward_name_registered_twice_is_an_error_naming_both():
    def register_rewards(register):
        register("math", lambda prompt, completion, **fields: 0.0)

    plugins = load_plugins(environ={"MEGA_LOAD_PLUGINS": "rl"},
                           extra=[("other", types.SimpleNamespace(register_rewards=hookimpl(register_rewards)))])
    with pytest.raises(DuplicateNameError, match="reward 'math' is registered twice.*'rl'.*'other'"):
        plugins.rewards.get("math")


@pytest.mark.parametrize("completion,answer,expected", [
    ("so the total is \\boxed{1,000}.", "1000", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("First 2+3=5. #### 5", "#### 5.0", 1.0),                  # GSM8K's marker on both sides
    ("She pays $18 in all.\n#### 18", "Janet ... #### 18", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{x^{2}+1}", "\\boxed{x^{2}+1}", 1.0),              # nested braces, compared as text
    ("\\boxed{7}", "8", 0.0),
    ("the answer is 7", "7", 0.0),                              # no final-answer marker
    ("\\boxed{7", "7", 0.0),                                    # unclosed box
])
def test_math_answer(completion, answer, expected):
    assert builtin_rewards.math_answer(prompt="q", completion=completion, answer=answer) == expected


def test_format_and_length_rewards():
    assert builtin_rewards.regex_format(prompt="q", completion="so \\boxed{4}") == 1.0
    assert builtin_rewards.regex_format(prompt="q", completion="4") == 0.0
    assert builtin_rewards.regex_format(prompt="q", completion="<think>a\nb</think>4",
                                        format_regex=r"^<think>.*</think>") == 1.0
    assert builtin_rewards.length_penalty(prompt="q", completion="x" * 50, target_length=100) == 0.0
    assert builtin_rewards.length_penalty(prompt="q", completion="x" * 350, target_length=100) == -0.25
    assert builtin_rewards.length_penalty(prompt="q", completion="x" * 5000) == -1.0


def test_weighted_rewards_per_completion_and_batched(pool, user_rewards):
    rewards = load_rewards(["user_rewards:exact:2", "user_rewards:batched_length:0.5"])
    scores = score(rewards, pool, ["p1", "p2", "p3"], ["4", "five", "6"],
                   [{"answer": "4"}, {"answer": "5"}, {"answer": "6"}])
    assert scores.per_reward["user_rewards:exact"] == [1.0, 0.0, 1.0]
    assert scores.per_reward["user_rewards:batched_length"] == [1.5, 4.0, 1.5]
    assert scores.total == [2.75, 2.0, 2.75]
    assert all(c.errors == c.timeouts == c.non_finite == 0 for c in scores.counts.values())
    assert scores.counts["user_rewards:exact"].calls == 3 and scores.counts["user_rewards:batched_length"].calls == 1


def test_failing_rewards_score_zero_are_counted_and_the_run_goes_on(pool, user_rewards):
    rewards = load_rewards(["user_rewards:exact", "user_rewards:raises", "user_rewards:sleeps",
                            "user_rewards:backtracks", "user_rewards:not_a_number", "user_rewards:batched_short"])
    completions = ["4", "nan", "inf", "none"]
    start = time.monotonic()
    scores = score(rewards, pool, ["p"] * 4, completions, [{"answer": "4"}] * 4)
    elapsed = time.monotonic() - start
    counts = scores.counts
    assert counts["user_rewards:raises"].errors == 4
    assert "RuntimeError: this reward is broken" in counts["user_rewards:raises"].first_error
    assert counts["user_rewards:sleeps"].timeouts == 4 and counts["user_rewards:backtracks"].timeouts == 4
    assert counts["user_rewards:not_a_number"].non_finite == 3  # NaN, inf and None
    assert counts["user_rewards:batched_short"].errors == 1     # one value for four completions
    assert "expected a list of 4" in counts["user_rewards:batched_short"].first_error
    assert scores.per_reward["user_rewards:not_a_number"] == [0.5, 0.0, 0.0, 0.0]
    assert scores.total == [1.5, 0.0, 0.0, 0.0]
    assert all(math.isfinite(value) for value in scores.total)
    # Eight hung calls on two workers, half a second each: killed at their limit (a sleeping one
    # would take a minute), their workers replaced while the other goes on.
    assert elapsed < 8 * 0.5 / 2 + 8, elapsed
    # The pool still works after its workers were killed and replaced.
    again = score(load_rewards(["user_rewards:exact"]), pool, ["p"], ["4"], [{"answer": "4"}])
    assert again.total == [1.0]


def test_a_reward_that_kills_its_worker_scores_zero(pool, user_rewards):
    scores = score(load_rewards(["user_rewards:exits", "user_rewards:exact"]), pool, ["p"], ["4"], [{"answer": "4"}])
    assert scores.counts["user_rewards:exits"].errors == 1
    assert "worker process died" in scores.counts["user_rewards:exits"].first_error
    assert scores.total == [1.0]
