"""``mega rl``'s KL reference, dynamic sampling, LoRA and MoE policies end to end (``mega.rl.command``).

CPU here (the run takes the machine's device; the logs compared are Python numbers), one
process, seeded, NullTokenizer prompts (space-separated ids). The reward is the built-in
``format``: 1 when the completion's text starts with the digit 1 (about 3 in 10 ids do), so
many groups of 4 score all 0 and dynamic sampling has groups to drop.
"""

from __future__ import annotations

import json
import random

import pytest

from mega.rl.command import main, run_rl

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "16",
         "--global-batch-size", "16", "--lr", "1e-2", "--eval-iters", "0", "--seed", "5", "--hidden-dropout", "0",
         "--attention-dropout", "0"]
TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "127"]  # a resumed run has its checkpoint's
LLAMA = ["--model-family", "llama", *MODEL]
MIXTRAL = ["--model-family", "mixtral", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
           *MODEL, *TOKENIZER]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rng = random.Random(0)
    lines = [{"prompt": " ".join(str(rng.randrange(16, 127)) for _ in range(4)), "format_regex": "^1"}
             for _ in range(40)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def argv(model, prompt_file, iters: int, *extra: str) -> list[str]:
    return [*model, "--prompt-data", str(prompt_file), "--reward", "format", "--reward-workers", "1",
            "--grpo-group-size", "4", "--grpo-prompts-per-step", "4", "--rl-max-new-tokens", "4",
            "--train-iters", str(iters), "--lr-decay-iters", "4", *extra]


def test_kl_and_dynamic_sampling_resume_exactly(prompt_file, tmp_path):
    options = ("--grpo-kl-beta", "0.05", "--rl-dynamic-sampling", "--rl-dynamic-sampling-max-rounds", "4")
    keys = ("reward_mean", "loss", "kl", "response_length", "sampling_rounds", "groups_filtered",
            "groups_without_signal", "iteration")
    whole = run_rl(argv([*LLAMA, *TOKENIZER], prompt_file, 2, *options))  # 2 GRPO steps of 1 optimizer step
    assert whole[1]["kl"] > 0 and whole[0]["sampling_rounds"] > 1  # groups were dropped and refilled
    first = run_rl(argv([*LLAMA, *TOKENIZER], prompt_file, 1, *options, "--save", str(tmp_path)))
    assert (tmp_path / "iter_0000001" / "rl_reference").is_dir()
    rest = run_rl(argv(LLAMA, prompt_file, 2, *options, "--save", str(tmp_path), "--load", str(tmp_path)))
    assert [log["step"] for log in first + rest] == [1, 2]
    # the resumed run's reference is the first run's initial policy (not the policy it loaded), its
    # prompts continue after every round the first run drew
    for got, want in zip(first + rest, whole, strict=True):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}


def test_lora_policy_with_kl_against_its_adapters_off(prompt_file, capsys):
    logs = run_rl(argv([*LLAMA, *TOKENIZER], prompt_file, 2, "--lora-rank", "4", "--grpo-kl-beta", "0.1"))
    assert len(logs) == 2 and logs[0]["kl"] == 0.0 < logs[1]["kl"]  # the first update starts at the reference
    assert all(log["logprob_gap_max"] < 1e-4 for log in logs) and "| kl 0.000 |" in capsys.readouterr().out


def test_mixtral_policy_with_routing_replay(prompt_file, capsys):
    logs = run_rl(argv(MIXTRAL, prompt_file, 2, "--moe-enable-routing-replay", "--grpo-iterations", "2",
                       "--rl-dynamic-sampling"))
    assert len(logs) == 1 and logs[0]["logprob_gap_max"] < 1e-4
    assert "sampling rounds" in capsys.readouterr().out


def test_bad_options_are_named(prompt_file, capsys):
    assert main(argv([*LLAMA, *TOKENIZER], prompt_file, 2, "--moe-enable-routing-replay")) == 2
    assert "routing replay needs a mixture-of-experts model" in capsys.readouterr().err
    assert main(argv(MIXTRAL, prompt_file, 2, "--moe-enable-routing-replay", "--recompute-granularity", "full")) == 2
    assert "--recompute-granularity full" in capsys.readouterr().err
