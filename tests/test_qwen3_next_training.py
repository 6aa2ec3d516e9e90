"""`mega train --model-family qwen3-next` at tp2 (with and without sequence parallelism), pp2 and ep2
computes what one process computes.

CPU, gloo, fp32 (the one-process reference pinned to the CPU as the gloo ranks are): the tiny
preset (four layers: Gated DeltaNet, gated attention, Gated DeltaNet, gated attention; four
experts top-2 beside a gated shared expert) trains 3 steps on Megatron's mock data with the
load-balancing loss on; on one world of 2 ranks the tensor-parallel (both kinds of heads split;
under sequence parallelism the linear layers' convolution runs over the gathered sequence),
pipeline-parallel (a linear and a full-attention layer per stage) and expert-parallel runs give
the one-process losses within 1e-5 (relative) at every step. No checkpoint is loaded, so an equal
first loss means equal initial weights too. Context parallelism is refused by name. `mega plan`
prints the 80b-a3b preset's memory per stage, and `mega train --model-family qwen3-next
--model-preset 80b-a3b --help` gives its sizes as the defaults.
"""

from __future__ import annotations

import pytest
import torch

from mega.train.testing.training_runs import assert_losses_close, train_each, train_losses

COMMON = [
    "--mock-data", "--model-family", "qwen3-next", "--model-preset", "tiny", "--seq-length", "16",
    "--vocab-size", "90", "--make-vocab-size-divisible-by", "32", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "0",
    "--log-interval", "100", "--seed", "7", "--moe-aux-loss-coeff", "0.01",
]
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2 sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "ep2": ["--expert-model-parallel-size", "2"],
}


@pytest.fixture
def on_cpu(monkeypatch):
    """This process's run on the CPU, as the gloo ranks' (a GPU machine would otherwise take it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_tp2_pp2_ep2_train_as_one_process(worlds, on_cpu):
    reference = train_losses(COMMON)
    assert reference[-1] < reference[0], "the tiny model should learn the mock data"
    ranks = worlds.run(2, train_each, [COMMON + extra for extra in LAYOUTS.values()])
    for rank in ranks:
        for name, losses in zip(LAYOUTS, rank, strict=True):
            assert_losses_close(losses, reference, f"qwen3-next {name}")


def test_context_parallelism_is_refused_by_name(on_cpu):
    from mega.core.config import ConfigError

    with pytest.raises(ConfigError, match="context.*qwen3-next"):
        train_losses(COMMON + ["--context-parallel-size", "2"])


def test_plan_prints_the_80b_memory(capsys):
    from mega.train.planning.plan_command import main

    assert main(["--model-family", "qwen3-next", "--model-preset", "80b-a3b", "--world-size", "64",
                 "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
                 "--expert-model-parallel-size", "8", "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16",
                 "--use-distributed-optimizer"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-next 80b-a3b on 64 GPUs" in out
    stages = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in "0123"]
    assert len(stages) == 4 and all(float(row[-1]) > 0 for row in stages)


def test_train_help_shows_the_preset_defaults(capsys):
    from mega.train.run_parser import parse_run

    with pytest.raises(SystemExit):
        parse_run(["--model-family", "qwen3-next", "--model-preset", "80b-a3b", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, value in (("--num-layers", 48), ("--hidden-size", 2048), ("--num-experts", 512),
                        ("--linear-num-value-heads", 32), ("--kv-channels", 256), ("--rotary-percent", 0.25)):
        help_line = text.split(f" {flag} {flag.lstrip('-').replace('-', '_').upper()} ", 1)[1].split(" --", 1)[0]
        assert f"(default: {value})" in help_line, (flag, help_line)
