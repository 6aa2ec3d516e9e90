"""The RL flags: parsed by mega's config parser from the one declaration, Megatron-RL's names,
checks that name the flag, and the options handed to the loss. CPU only."""

from __future__ import annotations

import argparse

import pytest

from mega.core.config import ConfigError, add_section, flag_reference, parse
from mega.rl.config import RLConfig

SECTIONS = {"rl": RLConfig}


def parse_rl(argv):
    parser = argparse.ArgumentParser(prog="mega rl")
    add_section(parser, "rl", RLConfig)
    return parse(argv, SECTIONS, parser)["rl"]


def test_megatron_flags_and_the_literatures_options():
    config = parse_rl([
        "--grpo-group-size", "4", "--grpo-prompts-per-step", "16", "--grpo-clamp-eps-lower", "0.2",
        "--grpo-clamp-eps-upper", "0.28", "--grpo-kl-beta", "0.001", "--grpo-entropy-term-weight", "0.01",
        "--rl-inference-logprobs-is-correction", "--rl-importance-sampling-truncation-coef", "2",
        "--grpo-loss-aggregation", "seq-mean-token-sum-norm", "--no-grpo-std-normalization",
        "--rl-dynamic-sampling", "--rl-overlong-buffer-length", "64", "--rl-max-new-tokens", "512",
        "--prompt-data", "p.jsonl", "--reward", "math:1", "format:0.2", "--reward-timeout", "5"])
    assert (config.grpo_group_size, config.grpo_prompts_per_step) == (4, 16)
    assert config.token_loss_options() == {"clamp_eps_lower": 0.2, "clamp_eps_upper": 0.28, "kl_beta": 0.001,
                                           "entropy_weight": 0.01, "is_truncation_coef": 2.0}
    assert config.aggregation_options() == {"mode": "seq-mean-token-sum-norm", "max_tokens": 512}
    assert not config.grpo_std_normalization and config.rl_dynamic_sampling
    assert config.reward == ["math:1", "format:0.2"] and config.reward_timeout == 5.0
    defaults = parse_rl([])
    assert defaults.grpo_std_normalization and defaults.grpo_loss_aggregation == "token-mean"
    assert defaults.reward == [] and defaults.grpo_kl_beta == 0.0


def test_the_flag_reference_names_the_papers():
    reference = flag_reference(SECTIONS)
    for flag, paper in [("--grpo-clamp-eps-upper", "DAPO"), ("--grpo-loss-aggregation", "Dr. GRPO"),
                        ("--grpo-std-normalization", "Dr. GRPO"), ("--rl-dynamic-sampling", "DAPO"),
                        ("--rl-overlong-filtering", "DAPO"), ("--rl-overlong-buffer-length", "DAPO"),
                        ("--grpo-kl-beta", "k3")]:
        assert any(line.startswith(f"| `{flag}`") and paper in line for line in reference.splitlines()), flag


@pytest.mark.parametrize("argv,message", [
    (["--grpo-group-size", "1"], "--grpo-group-size 1 has no group"),
    (["--grpo-clamp-eps-lower", "1.5"], "--grpo-clamp-eps-lower must be in"),
    (["--rl-importance-sampling-truncation-coef", "2"], "which is off"),
    (["--grpo-loss-aggregation", "seq-mean-token-sum-norm"], "needs --rl-max-new-tokens"),
    (["--rl-overlong-filtering"], "--rl-overlong-filtering needs --rl-max-new-tokens"),
    (["--rl-overlong-buffer-length", "600", "--rl-max-new-tokens", "512"], "exceeds --rl-max-new-tokens"),
    (["--reward-workers", "0"], "--reward-workers must be positive"),
    (["--grpo-kl-beta", "-1"], "--grpo-kl-beta must be >= 0"),
])
def test_bad_values_name_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_rl(argv)


def test_docs_rl_names_every_flag():
    from dataclasses import fields
    from pathlib import Path

    from mega.core.config import flag_of

    page = (Path(__file__).resolve().parents[3] / "docs" / "rl.md").read_text(encoding="utf-8")
    missing = [flag_of(f) for f in fields(RLConfig) if f"`{flag_of(f)}`" not in page]
    assert missing == [], f"docs/rl.md does not name {missing}"


def test_repeated_list_flags_add_up():
    config = parse_rl(["--reward", "math", "--reward", "format:0.2", "length", "--rl-stop", "a", "--rl-stop", "b"])
    assert config.reward == ["math", "format:0.2", "length"] and config.rl_stop == ["a", "b"]


def test_megatrons_list_flags_keep_the_last():
    # Only the fields that ask for it accumulate: mega train's list flags keep argparse's (and Megatron's) last-wins.
    from dataclasses import dataclass

    from mega.core.config.options import option

    @dataclass
    class Section:
        names: list[str] = option(default_factory=list, help="names")

    parser = argparse.ArgumentParser()
    add_section(parser, "s", Section)
    assert parse(["--names", "a", "--names", "b"], {"s": Section}, parser)["s"].names == ["b"]
