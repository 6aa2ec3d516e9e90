"""Which kernel backend trains a run in FP8: the one that has the run's ``--fp8-recipe``.

A backend declares the recipes it computes in ``fp8_recipes``; one with the ``fp8`` feature and
no such set is taken to have ``delayed`` (Transformer Engine's amax-history scaling, Megatron's
default recipe). The ``--kernels`` backend is asked first, so ``--kernels transformer-engine``
keeps FP8 in TE; otherwise any installed backend with the recipe (torchao's ``tensorwise`` and
``rowwise`` current scaling) does it, whatever backend fills the kernels.
"""

from __future__ import annotations

from mega.core.config import ConfigError

DELAYED = "delayed"


def recipes_of(backend) -> frozenset[str]:
    """The FP8 recipes ``backend`` trains in (none without the ``fp8`` feature)."""
    if "fp8" not in getattr(backend, "features", ()):
        return frozenset()
    return frozenset(getattr(backend, "fp8_recipes", {DELAYED}))


def fp8_backend(precision, kernels_name: str | None, plugins):
    """The backend that trains in ``precision.fp8_recipe`` (the ``--kernels`` one first); fails
    naming the recipe and what the installed backends offer."""
    recipe = precision.fp8_recipe
    names = ([kernels_name] if kernels_name else []) + [n for n in plugins.kernel_backends.names() if n != kernels_name]
    offers, reasons = {}, []
    for name in names:
        backend = plugins.kernel_backends.get(name)
        offers[name] = recipes_of(backend)
        if recipe in offers[name]:
            return backend
        if recipe in getattr(backend, "fp8_refused", {}):  # a backend that says why it lacks the recipe
            reasons.append(f"{name}: {backend.fp8_refused[recipe]}")
    offered = "; ".join(f"{name}: {', '.join(sorted(r))}" for name, r in offers.items() if r) or "none is installed"
    why = f" ({'; '.join(reasons)})" if reasons else ""
    raise ConfigError(f"--fp8-recipe {recipe}: no installed kernel backend trains in it{why}; "
                      f"FP8 recipes offered: {offered}")


def check_fp8_flags(precision, kernels_name: str | None, plugins) -> None:
    """The FP8 flags' combinations, before any work."""
    if precision.first_last_layers_bf16 and precision.fp8 is None:
        raise ConfigError("--first-last-layers-bf16 needs --fp8-format (it keeps layers out of FP8)")
    if precision.fp8 is None or precision.fp8_recipe == DELAYED:
        return
    fp8_backend(precision, kernels_name, plugins)
