"""The installed backend is selected by name and computes torch's tanh-approximated GELU."""

import pytest
import torch
import torch.nn.functional as F

from mega.core.kernels import Kernels
from mega.core.plugins import get_plugins


def test_the_backend_computes_torchs_gelu_tanh():
    kernels = Kernels({"activation": "plugin_name"}, get_plugins())
    x = torch.randn(4, 64, dtype=torch.float64)
    torch.testing.assert_close(kernels.activation("gelu_tanh")(x), F.gelu(x, approximate="tanh"))
    with pytest.raises(ValueError, match="gelu_tanh only"):
        kernels.activation("relu")
