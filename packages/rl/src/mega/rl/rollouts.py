"""Rollouts from mega's own decoder loop, on the training ranks.

:class:`RolloutEngine` runs the one decoder loop (``ContinuousBatchingWorker``, to completion)
over ``group_size`` completions of each prompt, from either of two models:

* the trainer's own module (the same parameter objects: after an optimizer step the engine
  generates from the new weights with nothing copied), where the engine's layout is the
  training layout: the same tensor-parallel size, one pipeline stage, no FSDP, no sequence or
  context parallelism, no expert parallelism;
* else a model of its own, built as ``mega serve`` builds one (every layer, tensor-parallel
  over ``--rl-inference-tensor-model-parallel-size`` consecutive ranks: the world is then that
  many ranks times engine replicas), whose weights :class:`~mega.rl.weight_sync.WeightSync`
  refreshes from the trainer's after every update, without disk.

The engine's data-parallel replicas split a step's prompts (contiguous shares, whole groups);
each replica's first rank scores its own completions (rewards run once per completion), and
every rank then holds every completion and reward. Completion ``i`` of a step samples with seed
``seed + step_seed + i`` whichever replica draws it, so the completions do not depend on the
number of replicas, and a run that resumes at a step draws the same ones. The KV cache lives for
one rollout: it is built for the step's requests and freed when the rollout ends.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from mega.core.parallel import Group, ParallelConfig, ParallelGroups
from mega.inference.engine.generation_engine import GenerationEngine, GenerationRequest, GenerationResult
from mega.inference.engine.sampling import SamplingParams
from mega.inference.engine.stopping import StopRules
from mega.inference.loader import build_model
from mega.rl.weight_sync import WeightSync


@dataclass(frozen=True)
class RolloutSampling:
    """The sampling flags of a rollout."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 0.0
    top_k: int = 0
    stop_strings: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()
    seed: int = 0


@dataclass
class Rollouts:
    """``group_size`` completions of each prompt, in prompt order."""

    prompts: list[list[int]]         # one per completion (repeated within its group)
    completions: list[list[int]]
    inference_logprobs: list[torch.Tensor]  # the engine's log-probability of each completion token
    finish_reasons: list[str]
    group_size: int
    seconds: float
    first_prompt: int = 0  # of the step's batch: the index of the prompt of the first completion
    rewards: torch.Tensor | None = None  # one per completion, where the engine scored them

    @property
    def sequences(self) -> list[torch.Tensor]:
        return [torch.tensor(p + c) for p, c in zip(self.prompts, self.completions, strict=True)]

    @property
    def generated_tokens(self) -> int:
        return sum(len(c) for c in self.completions)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / max(self.seconds, 1e-9)


class RolloutEngine:
    """The decoder loop over ``model`` (in eval mode during a rollout), tensor-parallel over
    ``tp_group``; ``replicas``: the group of the engine's data-parallel replicas (one rank of
    each, this rank's tensor-parallel rank), which split the prompts; ``weight_sync``: what
    refreshes ``model`` from the trainer (None: ``model`` is the trainer's own);
    ``compile_backend``: rollouts decode on the static KV cache (a slot per sequence) through the
    engine's forward compiled with this ``torch.compile`` backend once, in the first rollout, for
    all of them (the parameters, updated in place by the optimizer, are the compiled graph's
    inputs: nothing recompiles); None: eager, on the paged cache."""

    def __init__(self, model: torch.nn.Module, *, vocab_size: int, max_positions: int, tokenizer=None,
                 tp_group: Group | None = None, replicas: Group | None = None, weight_sync: WeightSync | None = None,
                 compile_backend: str | Callable | None = None):
        self.model = model
        self.compile_backend = compile_backend
        self.engine = GenerationEngine(model, vocab_size=vocab_size, max_positions=max_positions, tokenizer=tokenizer,
                                       tp_group=tp_group if tp_group is not None and tp_group.size > 1 else None)
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        self.weight_sync = weight_sync
        self.kv_cache = None  # a weak reference to the last rollout's KV cache (gone once it has ended)

    @property
    def is_leader(self) -> bool:
        """Whether this rank leads its replica's tensor group (it scores the replica's completions)."""
        return self.engine.is_leader

    @property
    def shares_trainer_weights(self) -> bool:
        return self.weight_sync is None

    def refresh(self) -> float:
        """Bring the engine's weights to the trainer's (collective); the seconds it took (0 when
        the engine generates from the trainer's own parameters)."""
        return self.weight_sync.refresh() if self.weight_sync is not None else 0.0

    def _share(self, count: int) -> tuple[int, int]:
        """The prompts ``[first, last)`` of ``count`` this replica generates for."""
        if self.replicas is None:
            return 0, count
        index, size = self.replicas.rank, self.replicas.size
        return count * index // size, count * (index + 1) // size

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], group_size: int, sampling: RolloutSampling,
                 step_seed: int = 0, reward_fn: Callable[[Rollouts], torch.Tensor] | None = None) -> Rollouts:
        """``group_size`` completions of every prompt; completion ``i`` of the batch samples with
        seed ``sampling.seed + step_seed + i`` (pass a different ``step_seed`` each step). This
        replica draws its share; with ``reward_fn`` its first rank scores them (``rewards``);
        every rank returns them all. Collective over the engine's ranks."""
        base = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        stop = StopRules(stop_ids=sampling.stop_ids, stop_strings=sampling.stop_strings)
        requests = [GenerationRequest(prompt=list(prompt), max_new_tokens=sampling.max_new_tokens,
                                      sampling=replace(base, seed=(sampling.seed + step_seed + index) % 2**63),
                                      stop=stop, logprobs=True, prompt_logprobs=False)  # the completions' alone
                    for index, prompt in enumerate(p for p in prompts for _ in range(group_size))]
        for request in requests:  # on every rank, so that a bad prompt stops them all alike
            self.engine.check(request)
        first, last = self._share(len(prompts))
        requests = requests[first * group_size:last * group_size]
        start = time.perf_counter()
        results = self._run(requests) if requests else []
        seconds = time.perf_counter() - start
        share = Rollouts(
            prompts=[r.tokens[:r.prompt_length] for r in results],
            completions=[r.generated for r in results],
            inference_logprobs=[_completion_logprobs(r) for r in results],
            finish_reasons=[str(r.finish_reason) for r in results],
            group_size=group_size, seconds=seconds, first_prompt=first,
        )
        if self.is_leader and reward_fn is not None:
            share.rewards = reward_fn(share).float()
        if self.engine.tp_group is not None:  # the leader's (its followers' results carry no log-probabilities)
            share = _broadcast_object(share if self.is_leader else None, self.engine.tp_group)
        return self._gathered(share)

    def _run(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """The decoder loop to completion on a KV cache sized for ``requests``, freed after: the
        paged cache, or with ``compile_backend`` the static one (a slot per sequence), whose decode
        step runs the engine's forward compiled once for all rollouts."""
        engine = self.engine
        was_training = self.model.training
        self.model.eval()  # before the worker: a compiled step is traced (warmed up) in eval mode
        worker = None
        try:
            # compiled: on the static cache, without CUDA-graph capture (which only that cache does)
            worker = engine.worker_for(requests, static_cache=self.compile_backend is not None,
                                       compile_backend=self.compile_backend, use_cuda_graphs=False)
            self.kv_cache = weakref.ref(worker.kv)
            return worker.run_to_completion(requests)
        finally:
            self.model.train(was_training)
            if worker is not None:
                # The worker's thread and callbacks refer back to it, so only the cycle collector would
                # free it; its cache is let go now (the update phase wants the memory), and a full
                # collection (a costly fraction of a second) runs only if something still holds it.
                worker.kv = worker.cache = worker.allocator = None
                del worker
                if self.kv_cache() is not None:
                    gc.collect()

    def _gathered(self, share: Rollouts) -> Rollouts:
        if self.replicas is None:
            return share
        shares: list = [None] * self.replicas.size
        dist.all_gather_object(shares, share, group=self.replicas.group)
        rewards = [s.rewards for s in shares]
        return Rollouts(
            prompts=[p for s in shares for p in s.prompts], completions=[c for s in shares for c in s.completions],
            inference_logprobs=[lp for s in shares for lp in s.inference_logprobs],
            finish_reasons=[f for s in shares for f in s.finish_reasons], group_size=share.group_size,
            seconds=max(s.seconds for s in shares),
            rewards=torch.cat(rewards) if all(r is not None for r in rewards) else None)


def _broadcast_object(value, group: Group):
    """``value`` of the group's first rank, on every rank of it."""
    holder = [value]
    dist.broadcast_object_list(holder, src=group.ranks[0], group=group.group)
    return holder[0]


def _completion_logprobs(result: GenerationResult) -> torch.Tensor:
    # result.logprobs covers tokens[1:]: the completion's start at prompt_length - 1.
    return torch.tensor(result.logprobs[result.prompt_length - 1:], dtype=torch.float32)


def completion_logprobs(sequence_logprobs: list[torch.Tensor], rollouts: Rollouts) -> list[torch.Tensor]:
    """The completion part of per-sequence log-probabilities (``len - 1`` per sequence, as
    :meth:`mega.rl.policy_engine.PolicyEngine.logprobs` gives them)."""
    return [lp[len(p) - 1:] for lp, p in zip(sequence_logprobs, rollouts.prompts, strict=True)]


def logprob_gap(engine: list[torch.Tensor], trainer: list[torch.Tensor]) -> dict:
    """The engine-vs-trainer log-probability gap over all completion tokens: mean and max |delta|."""
    if len(engine) != len(trainer):
        raise ValueError(f"{len(engine)} engine completions against {len(trainer)} of the trainer")
    deltas = (torch.cat(engine) - torch.cat(trainer)).abs() if engine else torch.zeros(0)
    if deltas.numel() == 0:
        return {"logprob_gap_mean": 0.0, "logprob_gap_max": 0.0}
    return {"logprob_gap_mean": deltas.mean().item(), "logprob_gap_max": deltas.max().item()}


def shares_training_layout(policy, tensor_parallel_size: int) -> bool:
    """Whether an engine at ``tensor_parallel_size`` can generate from the trainer's own module:
    the same tensor group, every layer on this rank, whole parameters, and a forward the decoder
    loop can run (no sequence, context or expert parallelism)."""
    parallel = policy.trainer.run.parallel
    return (tensor_parallel_size == parallel.tp and parallel.pp == 1 and parallel.cp == 1 and parallel.ep == 1
            and not parallel.sequence_parallel and not getattr(policy.chunk, "fully_sharded", False))


def build_rollout_engine(policy, tensor_parallel_size: int | None = None, tokenizer=None,
                         own_model: bool = False, compile_backend: str | None = None) -> RolloutEngine:
    """The engine of ``policy`` (a :class:`~mega.rl.policy_engine.PolicyEngine`) at
    ``tensor_parallel_size`` (default: the training's): on the trainer's own module where the
    layouts allow (:func:`shares_training_layout`) and ``own_model`` is false, else on a model of
    its own, refreshed from the trainer's weights now and by :meth:`RolloutEngine.refresh`
    (``own_model``: a benchmark's way to time the refresh at any layout); ``compile_backend``:
    the decode step compiled (:class:`RolloutEngine`), at tensor-parallel size 1. Collective."""
    trainer, groups = policy.trainer, policy.groups
    config = trainer.run.model
    size = tensor_parallel_size or trainer.run.parallel.tp
    if compile_backend is not None and size > 1:
        raise ValueError(f"--rl-inference-compile-backend runs an engine at tensor-parallel size 1 for now; the "
                         f"engine's is {size} (--rl-inference-tensor-model-parallel-size)")
    limits = {"vocab_size": config.vocab_size, "max_positions": config.max_position_embeddings or config.seq_length,
              "tokenizer": tokenizer, "compile_backend": compile_backend}
    if shares_training_layout(policy, size) and not own_model:
        return RolloutEngine(policy.model, tp_group=groups.tp, replicas=groups.dp, **limits)
    world = groups.world_size
    if size < 1 or world % size:
        raise ValueError(f"--rl-inference-tensor-model-parallel-size {size} does not divide the {world} ranks")
    engine_groups = ParallelGroups(ParallelConfig(tp=size))
    model = build_model(trainer.family, config, engine_groups, groups.device, trainer.dtype)
    sync = WeightSync(trainer.chunks, groups, model, engine_groups, config.vocab_size, trainer.optimizer)
    sync.refresh()
    return RolloutEngine(model, tp_group=engine_groups.tp, replicas=engine_groups.dp, weight_sync=sync, **limits)
