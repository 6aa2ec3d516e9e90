"""The generation engine: one decoder loop (:mod:`.continuous`: continuous batching over the paged
or the static KV cache, :mod:`.kv_caches`) that every entry point submits requests to, one
decode step (:mod:`.decode_step`: token choice, log-probabilities, endings), one sampler
(:mod:`.sampling`) and one rule for stop, length and cancellation (:func:`.requests.ending`).

The names below are what callers outside the engine use; inside it, modules import each other
by their own names. They load on first use: importing a light module of the engine (stopping
rules, requests) must not import torch, which ``mega --help`` and the CLIs' argument checks avoid.
"""

import importlib

_HOMES = {"EngineBase": "generation_engine", "GenerationEngine": "generation_engine", "FinishReason": "requests",
          "GenerationError": "requests", "GenerationRequest": "requests", "GenerationResult": "requests"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
