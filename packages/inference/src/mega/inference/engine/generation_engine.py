"""``GenerationEngine``: a decoder model and its limits, for the one decoder loop.

The engine holds what every path shares: the model, its real vocabulary and positions, the
tokenizer's stop rules and the tensor group; it checks requests and runs forwards. Generating is
the decoder loop's (:class:`~mega.inference.engine.continuous.ContinuousBatchingWorker`);
:meth:`GenerationEngine.generate` runs it to completion over a batch of requests, as ``mega
generate`` does. Choosing tokens, log-probabilities and endings is
:class:`~mega.inference.engine.decode_step.DecodeStep`'s job.

Under tensor parallelism every rank of the tensor group runs ``generate`` on the same requests;
the logits' vocabulary shards are gathered, the first rank of the group samples and decides who
stops, and broadcasts both each step, so the ranks never disagree (cancellations, unseeded
sampling and stop strings happen on the first rank only).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence

import torch

from mega.core.parallel import Group
from mega.core.parallel.collectives import gather_along
from mega.inference.engine.continuous import BLOCK_SIZE, ContinuousBatchingWorker
from mega.inference.engine.decode_step import READ_LAG, DecodeStep
from mega.inference.engine.requests import (
    FinishCallback,
    FinishReason,
    GenerationError,
    GenerationRequest,
    GenerationResult,
    TokenCallback,
)
from mega.inference.engine.stopping import StopChecker

# A decoder layer's attention module (Megatron-Core's names): where a sliding window is read.
LAYER_ATTENTION = re.compile(r"(?:.*\.)?layers\.(\d+)\.self_attention")

__all__ = ["EngineBase", "FinishReason", "GenerationEngine", "GenerationError", "GenerationRequest",
           "GenerationResult"]




class EngineBase:
    """What every engine shares: the model and its limits, the tensor group, the stop rules, and
    the request checks that do not depend on the architecture."""

    def __init__(self, model: torch.nn.Module, *, vocab_size: int, max_positions: int, tokenizer=None,
                 tp_group: Group | None = None, read_lag: int | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        # Steps between choosing tokens on the device and reading them (default: READ_LAG on an
        # accelerator; 0 on the CPU, which is the host: reading late would only hold each token
        # back two steps, the first streamed one too, and decode rows past their stops).
        self.read_lag = read_lag if read_lag is not None else 0 if self.device.type == "cpu" else READ_LAG
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.length_limit = f"the model's {max_positions} positions"  # what max_positions is, in errors
        self.tokenizer = tokenizer
        self.tp_group = tp_group
        self.lora = None  # a MultiLoRA (mega.models.lora.multi) when adapters are chosen per request
        self.stop_checker = StopChecker(tokenizer)

    def cap_length(self, max_model_len: int) -> None:
        """``--max-model-len``: no sequence (prompt and generated tokens) longer, and caches sized
        for that (they take ``max_positions``)."""
        if not 0 < max_model_len <= self.max_positions:
            raise GenerationError(f"--max-model-len must be in [1, {self.max_positions}] (the model's positions), "
                                  f"got {max_model_len}")
        self.max_positions, self.length_limit = max_model_len, f"--max-model-len {max_model_len}"

    @property
    def is_leader(self) -> bool:
        return self.tp_group is None or self.tp_group.rank == 0

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def decode_step(self, on_token=None, on_finish=None) -> DecodeStep:
        """A :class:`DecodeStep` over this engine's stop rules, device and tensor group."""
        return DecodeStep(self.stop_checker, self.device, self.tp_group, on_token, on_finish, self.read_lag)

    def real_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Fp32 logits over the real vocabulary, every tensor shard gathered."""
        group = self.tp_group
        if group is not None and group.size > 1:
            logits = gather_along(logits, group, dim=-1)
        return logits[..., : self.vocab_size].float()

    def check_prompt(self, request: GenerationRequest) -> None:
        if not request.prompt:
            raise GenerationError("the prompt is empty: give at least one token")
        if bad := [t for t in request.prompt if not 0 <= t < self.vocab_size]:
            raise GenerationError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")


class GenerationEngine(EngineBase):
    """Generates with ``model``: a whole decoder (first and last stage) in eval mode, tensor-parallel
    over ``tp_group`` or not, whose forward takes ``inference_cache`` and ``logits_to_keep`` (as
    :class:`mega.models.blocks.language_model.LanguageModel`'s does). ``vocab_size``: the real
    vocabulary (padded rows are never chosen); ``max_positions``: the longest sequence (prompt
    and generation) the model takes; ``tokenizer``: for stop strings and end-of-line rules."""

    def __init__(self, model: torch.nn.Module, *, vocab_size: int, max_positions: int, tokenizer=None,
                 tp_group: Group | None = None, read_lag: int | None = None):
        missing = {"inference_cache", "logits_to_keep"} - set(inspect.signature(model.forward).parameters)
        if missing:
            raise GenerationError(f"{type(model).__name__}.forward takes no {' or '.join(sorted(missing))}: "
                                  "this model family cannot generate")
        super().__init__(model, vocab_size=vocab_size, max_positions=max_positions, tokenizer=tokenizer,
                         tp_group=tp_group, read_lag=read_lag)
        self._compiled: dict = {}  # torch.compile backend -> the compiled forward (compiled_forward)
        self.warmed_windows: set[tuple] = set()  # (backend, rows, new tokens) the compiled forward has run

    def check(self, request: GenerationRequest) -> None:
        """Raise :class:`GenerationError` for a request that cannot run, naming the numbers."""
        self.check_prompt(request)
        if request.max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens must be >= 0, got {request.max_new_tokens}")
        total = len(request.prompt) + request.max_new_tokens
        if total > self.max_positions:
            raise GenerationError(
                f"{len(request.prompt)} prompt tokens + {request.max_new_tokens} tokens to generate = "
                f"{total} exceeds {self.length_limit}"
            )

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache,
                logits_to_keep: int | torch.Tensor | None = None) -> torch.Tensor:
        """Fp32 logits ``[seq (or logits_to_keep), batch, vocab]`` of ``tokens`` ``[batch, seq]`` at
        ``positions``, continuing what ``cache`` holds (any cache the model's attention takes:
        :class:`KVCache`, the paged or the static one)."""
        logits = self.model(tokens, positions, inference_cache=cache, logits_to_keep=logits_to_keep)
        return self.real_logits(logits)

    def compiled_forward(self, backend: str | Callable) -> Callable:
        """:meth:`forward` through ``torch.compile`` with ``backend``, compiled once for this engine:
        every worker over it (the RL rollouts build one per rollout) runs the same compiled code,
        whose cache a fresh ``torch.compile`` would not share. The parameters are the graph's
        inputs, not constants, so weights updated in place (the trainer's) need no recompilation."""
        compiled = self._compiled.get(backend)
        if compiled is None:
            # On the CPU inductor's kernels are called from C++ (cpp_wrapper), not from generated
            # Python: a decode step of a small model is bound by that calling (about a fifth of it).
            options = {"cpp_wrapper": True} if backend == "inductor" and self.device.type == "cpu" else None
            compiled = self._compiled[backend] = torch.compile(self.forward, backend=backend, options=options)
        return compiled

    @property
    def layer_windows(self) -> dict[int, int]:
        """Layer number -> its attention's sliding window, for the layers that have one (a cache
        may then keep only the window's keys)."""
        windows = {}
        for name, module in self.model.named_modules():
            match = LAYER_ATTENTION.fullmatch(name)
            window = getattr(module, "sliding_window", None)
            if match and isinstance(window, int):
                windows[int(match.group(1))] = window
        return windows

    @property
    def kv_head_repeats(self) -> int:
        """Query heads per key head where the attention kernel repeats key heads itself
        (everywhere but CUDA's native grouped-query attention), else 1."""
        config = getattr(self.model, "config", None)
        heads, groups = getattr(config, "num_attention_heads", None), getattr(config, "num_query_groups", None)
        if self.device.type == "cuda" or not heads or not groups:
            return 1
        return heads // groups

    def generate(self, requests: Sequence[GenerationRequest], on_token: TokenCallback | None = None,
                 on_finish: FinishCallback | None = None, static_cache: bool = False) -> list[GenerationResult]:
        """Run ``requests`` together through the decoder loop to their ends, on a cache sized for
        them (the paged one, or with ``static_cache`` a slot each); callbacks name a request by
        its index."""
        for request in requests:
            self.check(request)
        return self.worker_for(requests, static_cache=static_cache).run_to_completion(requests, on_token, on_finish)

    def worker_for(self, requests: Sequence[GenerationRequest], static_cache: bool = False,
                   **options) -> ContinuousBatchingWorker:
        """A decoder loop with a row for each of ``requests`` and a cache sized for them all at once:
        the paged one (the blocks of each prompt and its tokens to generate), or with
        ``static_cache`` a slot each; ``options``: the worker's others (``compile_backend``...)."""
        blocks = sum(-(-(len(r.prompt) + r.max_new_tokens) // BLOCK_SIZE) for r in requests)
        tokens = len(requests) * self.max_positions if static_cache else blocks * BLOCK_SIZE
        return ContinuousBatchingWorker(self, max_batch_size=len(requests), max_num_tokens=tokens,
                                        static_cache=static_cache, **options)
