"""``mega rl`` end to end (``mega.rl.command``): a tiny model learns a toy reward, and a resumed
run continues exactly.

CPU, one process, seeded. Prompts are NullTokenizer text (space-separated ids, vocabulary 127
plus the end of document); the reward is the built-in ``length``: minus the completion's length
in characters over 20 (``length_scale`` on each line), so ids of fewer digits and an early end
of document score higher; about -0.85 for the random initial policy with 6 new tokens.
"""

from __future__ import annotations

import json
import random

import pytest

from mega.rl.command import main, run_rl

MODEL = ["--model-family", "llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--micro-batch-size", "16",
         "--global-batch-size", "16", "--lr", "1e-2", "--eval-iters", "0", "--seed", "5", "--hidden-dropout", "0",
         "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rng = random.Random(0)
    lines = [{"prompt": " ".join(str(rng.randrange(16, 127)) for _ in range(4)), "length_scale": 20}
             for _ in range(24)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def argv(prompt_file, iters: int, *extra: str) -> list[str]:
    return [*MODEL, "--prompt-data", str(prompt_file), "--reward", "length", "--reward-workers", "1",
            "--grpo-group-size", "4", "--grpo-prompts-per-step", "8", "--rl-max-new-tokens", "6",
            "--train-iters", str(iters), *extra]


def test_mega_rl_learns_the_reward(prompt_file, capsys):
    # 12 GRPO steps of 32 completions, 2 passes of 2 optimizer steps each
    logs = run_rl(argv(prompt_file, 48, "--grpo-iterations", "2", "--lr-decay-style", "constant"))
    rewards = [log["reward_mean"] for log in logs]
    assert len(logs) == 12 and logs[-1]["iteration"] == 48
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards
    assert all(log["logprob_gap_max"] < 1e-4 for log in logs)
    line = capsys.readouterr().out.splitlines()[0]
    for part in ("rl step 1 |", "rollout", "tokens/s", "logprobs", "update", "refresh", "reward", "length", "clip",
                 "entropy", "logprob gap mean"):
        assert part in line, line


def test_resumed_run_continues_exactly(prompt_file, tmp_path):
    # The learning rate decays over --train-iters unless told otherwise: the same decay for all three.
    schedule = ("--lr-decay-iters", "8")
    keys = ("reward_mean", "reward_std", "loss", "response_length", "clip_fraction", "iteration")
    whole = run_rl(argv(prompt_file, 8, "--grpo-iterations", "2", *schedule))  # 2 GRPO steps of 4 optimizer steps
    first = run_rl(argv(prompt_file, 4, "--grpo-iterations", "2", *schedule, "--save", str(tmp_path)))
    resume = argv(prompt_file, 8, "--grpo-iterations", "2", *schedule, "--save", str(tmp_path), "--load", str(tmp_path))
    for flag in ("--vocab-size", "--tokenizer-type"):  # the checkpoint gives the model and its tokenizer
        at = resume.index(flag)
        resume = resume[:at] + resume[at + 2:]
    rest = run_rl(resume)
    assert [log["step"] for log in first + rest] == [1, 2]
    for got, want in zip(first + rest, whole, strict=True):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}


def test_bad_flags_are_named(prompt_file, capsys):
    assert main([*MODEL, "--reward", "format", "--rl-max-new-tokens", "6", "--train-iters", "2"]) == 2
    assert "needs --prompt-data" in capsys.readouterr().err
    assert main([*argv(prompt_file, 2), "--grpo-prompts-per-step", "3"]) == 2
    assert "not a multiple of --global-batch-size 16" in capsys.readouterr().err


def test_megatrons_perform_rl_step_spelling_runs_mega_rl(prompt_file, capsys):
    from mega.core.cli.main import main as mega

    assert mega(["train", "--perform-rl-step", *MODEL, "--reward", "length", "--rl-max-new-tokens", "6"]) == 2
    assert "mega rl: error: mega rl needs --prompt-data" in capsys.readouterr().err
    code = mega(["train", "--perform-rl-step", *argv(prompt_file, 2)])
    assert code == 0 and "rl step 1 | iteration 2" in capsys.readouterr().out


def test_compiled_rollouts_draw_what_eager_rollouts_draw(prompt_file):
    # --rl-inference-compile-backend (dynamo's eager backend: traced, the graph run as traced): the static cache's
    # compiled decode step samples the eager paged engine's completions, so the runs match.
    keys = ("reward_mean", "response_length", "loss", "clip_fraction")
    eager = run_rl(argv(prompt_file, 4))  # 2 GRPO steps of 2 optimizer steps
    compiled = run_rl(argv(prompt_file, 4, "--rl-inference-compile-backend", "eager"))
    assert [[log[k] for k in keys] for log in compiled] == [[log[k] for k in keys] for log in eager]
    with pytest.raises((ValueError, SystemExit), match="tensor-parallel size 1"):
        run_rl(argv(prompt_file, 4, "--rl-inference-compile-backend", "eager",
                    "--rl-inference-tensor-model-parallel-size", "2"))
