"""A third-party plugin, built and installed outside the tree, fills the core's contracts: a model
family that is not GPT-shaped (parallel attention+MLP blocks; two tensors cross every pipeline
boundary) and a norm kernel backend. `mega train` runs it at tp2 x pp2 and computes what one
process computes, with no change to the core (tests/plugins/mega-parallel-block)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN = Path(__file__).parent / "plugins" / "mega-parallel-block"
COMMON = ["--model-family", "parallel-block", "--model-preset", "tiny", "--mock-data", "--train-iters", "4",
          "--log-interval", "1", "--eval-iters", "0", "--micro-batch-size", "2", "--global-batch-size", "8",
          "--normalization-backend", "hand-norm", "--lr", "1e-3", "--seed", "3"]


@pytest.fixture(scope="module")
def plugin_env(install_plugins):
    return install_plugins(PLUGIN)


def mega(env, *args, check=True):
    result = subprocess.run([sys.executable, "-m", "mega.core.cli.main", *args], capture_output=True, text=True,
                            env=env, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def losses(output: str, name: str = "lm loss") -> list[float]:
    return [float(value) for value in re.findall(name + r": ([0-9.E+-]+) \|", output)]


def test_the_plugin_family_trains_at_tp2_pp2_as_one_process(plugin_env, tmp_path):
    listing = mega(plugin_env, "plugins").stdout
    assert "parallel-block" in listing and "hand-norm" in listing
    one = mega(plugin_env, "train", *COMMON).stdout
    assert len(losses(one)) == 4 and losses(one)[-1] < losses(one)[0]
    four = mega(plugin_env, "train", "--nproc-per-node", "4", "--tensor-model-parallel-size", "2",
                "--pipeline-model-parallel-size", "2", *COMMON).stdout
    # The family's auxiliary loss is logged beside lm loss, averaged over micro-batches and ranks.
    for name in ("lm loss", "activation loss"):
        assert len(losses(one, name)) == 4
        for step, (got, want) in enumerate(zip(losses(four, name), losses(one, name), strict=True)):
            assert abs(got - want) <= 1e-5 * abs(want), f"{name}, step {step + 1}: tp2 x pp2 {got} != one process {want}"


def test_the_plugin_norm_is_the_one_used_and_a_typo_is_named(plugin_env):
    code = ("from mega.core.build import build_stage; from mega.core.kernels import Kernels\n"
            "from mega.core.plugins import get_plugins\n"
            "from mega_parallel_block.norm import HandNorm\n"
            "family = get_plugins().models.get('parallel-block'); config = family.preset('tiny')\n"
            "model = build_stage(family, config, kernels=Kernels({'norm': 'hand-norm'}))\n"
            "assert isinstance(model.layers['0'].norm, HandNorm) and isinstance(model.final_norm, HandNorm)\n"
            "import torch; model({'tokens': torch.zeros(1, 4, dtype=torch.long)})\n"
            "print(HandNorm.calls)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=plugin_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "5"  # four blocks and the final norm
    bad = mega(plugin_env, "train", *COMMON[:-6], "--normalization-backend", "hand-norn", check=False)
    assert bad.returncode == 2
    assert "no kernel backend 'hand-norn'; did you mean hand-norm" in bad.stderr
