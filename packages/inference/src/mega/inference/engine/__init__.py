"""The generation engine: one decoder loop (:mod:`.continuous`: continuous batching over the paged
or the static KV cache, :mod:`.kv_caches`) that every entry point submits requests to, one
decode step (:mod:`.decode_step`: token choice, log-probabilities, endings), one sampler
(:mod:`.sampling`) and one rule for stop, length and cancellation (:mod:`.stopping`).

The names below are what callers outside the engine use; inside it, modules import each other
by their own names.
"""

from mega.inference.engine.generation_engine import EngineBase, GenerationEngine
from mega.inference.engine.requests import FinishReason, GenerationError, GenerationRequest, GenerationResult

__all__ = ["EngineBase", "FinishReason", "GenerationEngine", "GenerationError", "GenerationRequest",
           "GenerationResult"]
