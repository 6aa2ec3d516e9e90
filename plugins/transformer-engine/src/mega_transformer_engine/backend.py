"""The ``transformer-engine`` kernel backend: TE's modules for the kinds they fill.

``norm_linear`` is TE's LayerNormLinear (QKV, and fc1 where the MLP is not fused, with the norm
before them fused in), ``norm_mlp`` TE's LayerNormMLP (norm, fc1, activation and fc2 in one
module, for the activations TE computes exactly), ``linear`` TE's Linear (the output projections), ``norm`` TE's LayerNorm/RMSNorm (the final
norm), ``attention`` TE's DotProductAttention. The linear layers do their own tensor- and
sequence-parallel communication (:mod:`mega_transformer_engine.layers`). The ``fp8`` feature
lets ``--fp8-format`` / ``--fp8-hybrid`` run: :mod:`mega_transformer_engine.fp8` enters
``fp8_autocast`` around every forward.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from mega_transformer_engine.availability import Environment


class TransformerEngineBackend:
    name = "transformer-engine"
    kinds = frozenset({"norm", "linear", "norm_linear", "norm_mlp", "attention"})
    features = frozenset({"fp8"})

    def __init__(self, probe: Callable[[], Environment] = Environment.probe):
        self._probe = probe  # what the machine has; tests pass their own

    def is_available(self) -> tuple[bool, str]:
        missing = self._probe().missing()
        return not missing, missing

    def fp8_available(self) -> tuple[bool, str]:
        missing = self._probe().missing(fp8=True)
        return not missing, missing

    def component(self, kind: str):
        # optional dependency: the kernel library may be absent; the backend reports it
        from mega_transformer_engine import layers

        te = importlib.import_module("transformer_engine.pytorch")
        factories = {"norm": layers.norm_factory, "linear": layers.linear_factory,
                     "norm_linear": layers.norm_linear_factory, "norm_mlp": layers.norm_mlp_factory,
                     "attention": layers.TEAttention}
        return factories[kind](te)


BACKEND = TransformerEngineBackend()
