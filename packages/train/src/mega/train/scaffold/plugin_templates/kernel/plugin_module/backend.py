"""The backend: ``kinds``, ``component(kind)`` and ``is_available()``."""

import math

import torch


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def activation(name: str):
    """The ``activation`` component: ``factory(name) -> fn``."""
    if name != "gelu_tanh":
        raise ValueError(f"the plugin_name kernel backend computes gelu_tanh only, not {name!r}")
    return gelu_tanh


class Backend:
    name, kinds = "plugin_name", frozenset({"activation"})

    def is_available(self) -> tuple[bool, str]:
        return True, ""  # or (False, "what is missing, and how to install it")

    def component(self, kind: str):
        return {"activation": activation}[kind]


BACKEND = Backend()
