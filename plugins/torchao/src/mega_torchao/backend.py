"""The ``torchao`` backend: no component kinds, only the ``fp8`` feature with the current-scaling
recipes torchao computes. :func:`mega.core.fp8_recipes.fp8_backend` picks it for
``--fp8-recipe tensorwise|rowwise``; the pass itself is :func:`mega_torchao.fp8.apply_fp8`."""

from __future__ import annotations

from mega.core.kernel_requirements import package_problem

MIN_VERSION = "0.18"
RECIPES = frozenset({"tensorwise", "rowwise"})
# The GPU each recipe's matrix product needs (torch._scaled_mm); the CPU runs both.
MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0)}
# Recipes Megatron names that torchao's float8 training does not compute here: said by name.
FP8_REFUSED = {
    "mxfp8": "MX FP8 (32-element blocks) is torchao's prototype MX training for Blackwell (compute capability "
             ">= 10.0); mega-torchao does not wire it",
    "blockwise": "128x128 block scaling is torchao's prototype blockwise training; mega-torchao does not wire it",
}


class TorchaoBackend:
    name = "torchao"
    kinds = frozenset()
    features = frozenset({"fp8"})
    fp8_recipes = RECIPES
    fp8_refused = FP8_REFUSED

    def is_available(self) -> tuple[bool, str]:
        problem = package_problem("torchao.float8", "torchao", MIN_VERSION)
        return not problem, problem

    def component(self, kind: str):
        raise KeyError(f"the torchao backend fills no component kind ({kind!r}); it trains in FP8 (--fp8-recipe)")


BACKEND = TorchaoBackend()
