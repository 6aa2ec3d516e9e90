"""--activation: every MLP activation the kernel backends offer, one flag; conflicting flags refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mega.core.kernels import Kernels
from mega.models import variant
from mega.models.blocks.mlp import MLP
from mega.models.config import MLP_ACTIVATIONS, ModelConfigError, TransformerConfig
from mega.models.gpt import family as gpt
from mega.models.torch_kernels import activation as torch_activation

EXPECTED = {  # torch's own functions (Megatron's squared_relu is relu(x)**2)
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
    "squared_relu": lambda x: F.relu(x) ** 2, "swiglu": lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1],
}


@pytest.mark.parametrize("name", MLP_ACTIVATIONS)
def test_each_activation_is_the_mlps(name):
    config = TransformerConfig(hidden_size=32, num_attention_heads=2, activation=name)
    assert config.mlp_activation == name and config.swiglu == (name == "swiglu")
    # Megatron's flag of the same meaning is set, so exports that read the flags see it.
    assert config.openai_gelu == (name == "gelu_tanh") and config.squared_relu == (name == "squared_relu")
    mlp = MLP(config, Kernels({}))
    x = torch.randn(3, 32)
    want = mlp.linear_fc2(EXPECTED[name](mlp.linear_fc1(x)))
    torch.testing.assert_close(mlp(x), want)
    torch_activation(name)  # the default backend offers it


def test_megatrons_flags_and_conflicts():
    assert TransformerConfig(squared_relu=True).mlp_activation == "squared_relu"
    assert TransformerConfig(openai_gelu=True, activation="gelu_tanh").mlp_activation == "gelu_tanh"
    with pytest.raises(ModelConfigError, match=r"--swiglu \(swiglu\), --activation \(relu\)"):
        TransformerConfig(swiglu=True, activation="relu")
    with pytest.raises(ModelConfigError, match="--activation must be one of"):
        TransformerConfig(activation="tanh")


def test_a_variant_defaults_to_its_values_and_flags_still_override():
    family = variant(gpt.FAMILY, "gpt-relu", activation="relu")
    assert family.name == "gpt-relu" and family.config_class().mlp_activation == "relu"
    tiny = family.preset("tiny")
    assert tiny.mlp_activation == "relu" and tiny.hidden_size == gpt.FAMILY.preset("tiny").hidden_size
    assert dataclasses.replace(tiny, activation="gelu").mlp_activation == "gelu"
    with pytest.raises(TypeError, match="no field activaton"):
        variant(gpt.FAMILY, "x", activaton="relu")
