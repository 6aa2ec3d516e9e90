"""Checkpoints do not depend on the kernels a run used: a backend that fuses the norm into the
next linear layer (its weights under its own names, state of its own in ``get_extra_state``)
saves canonical names, and its checkpoints load into torch-native runs and the other way round,
continuing with the losses an uninterrupted run has."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mega.core.plugins import get_plugins, hookimpl

TINY = ["--mock-data", "--model-family", "gpt", "--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-3", "--lr-decay-style", "constant", "--eval-iters", "0",
        "--log-interval", "100", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5"]
FUSED = ["--norm-linear-backend", "fused-norm-linear"]


class NormLinear(nn.Module):
    """LayerNorm/RMSNorm then a linear layer, in one module with Transformer Engine's names. Its
    extra state counts the forwards it ran (standing in for FP8 scaling history)."""

    def __init__(self, norm_kind, in_features, out_features, bias, eps):
        super().__init__()
        self.norm_kind, self.eps = norm_kind, eps
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features))
        self.layer_norm_bias = nn.Parameter(torch.zeros(in_features)) if norm_kind == "LayerNorm" else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        if self.norm_kind == "LayerNorm":
            x = F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, self.eps)
        else:
            x = F.rms_norm(x, x.shape[-1:], self.layer_norm_weight, self.eps)
        return F.linear(x, self.weight, self.bias)

    def get_extra_state(self):
        return torch.tensor([self.forwards], dtype=torch.int64)

    def set_extra_state(self, state):
        self.forwards = int(state[0])


class FusedBackend:
    name, kinds = "fused-norm-linear", frozenset({"norm_linear"})

    def is_available(self):
        return True, ""

    def component(self, kind):
        return NormLinear


class _Plugin:
    @hookimpl
    def register_kernel_backends(self, register):
        register("fused-norm-linear", FusedBackend())


@pytest.fixture(scope="module", autouse=True)
def fused_backend():
    plugins = get_plugins()
    if "fused-norm-linear" not in plugins.kernel_backends:
        plugins.add(_Plugin(), "fused-norm-linear-test")


def train(argv):
    from mega.train.command import parse_run
    from mega.train.launch_run import run_training

    run, family = parse_run(argv)
    return run_training(run, family).losses


def test_checkpoints_move_between_kernel_backends(tmp_path):
    from mega.core.checkpoint.sharded_io import read_index

    straight = train(TINY + ["--train-iters", "5"])
    fused_ckpt, torch_ckpt = tmp_path / "fused", tmp_path / "torch"
    first = train(TINY + FUSED + ["--train-iters", "3", "--save", str(fused_ckpt)])
    assert first == pytest.approx(straight[:3], rel=1e-5)  # the fused module computes the same function

    keys = set(read_index(fused_ckpt / "iter_0000003"))
    assert "model.decoder.layers.0.input_layernorm.weight" in keys
    assert not any("layer_norm_weight" in key for key in keys)
    assert "buffer.decoder.layers.0.self_attention.linear_qkv._extra_state.tp0of1" in keys

    resumed_by_torch = train(TINY + ["--train-iters", "5", "--load", str(fused_ckpt)])
    assert resumed_by_torch == pytest.approx(straight[3:], rel=1e-5)

    train(TINY + ["--train-iters", "3", "--save", str(torch_ckpt)])
    resumed_fused = train(TINY + FUSED + ["--train-iters", "5", "--load", str(torch_ckpt)])
    assert resumed_fused == pytest.approx(straight[3:], rel=1e-5)


def test_extra_state_comes_back_with_the_same_backend(tmp_path):
    from mega.core.build import build_stage
    from mega.core.checkpoint import load_model_weights
    from mega.core.kernels import Kernels

    train(TINY + FUSED + ["--train-iters", "2", "--save", str(tmp_path)])
    from mega.train.command import parse_run

    run, family = parse_run(TINY + ["--train-iters", "2"])  # the model config exactly as mega train makes it
    config = run.model
    model = build_stage(family, config, kernels=Kernels({"norm_linear": "fused-norm-linear"}), init=False)
    load_model_weights(tmp_path, [model])
    # 2 steps x 2 micro-batches, one forward each (no recompute)
    assert model.decoder.layers["0"].self_attention.linear_qkv.forwards == 4
