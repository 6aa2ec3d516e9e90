"""Rollouts from the one decoder loop on the policy's own parameters (``mega.rl.rollouts``).

CPU, one process. The engine's greedy tokens are checked against the argmax of the trainer's
log-probabilities, its log-probabilities against the trainer's (the gap), before and after an
optimizer step: the engine holds the trainer's parameter objects, so a stale copy would fail.
"""

from __future__ import annotations

import torch

from mega.rl.policy_engine import PolicyEngine
from mega.rl.rollouts import RolloutEngine, RolloutSampling, completion_logprobs, logprob_gap

ARGV = ["--model-family", "llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "128",
        "--micro-batch-size", "4", "--global-batch-size", "4", "--lr", "3e-2", "--eval-iters", "0", "--seed", "5",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "10"]
PROMPTS = [[3, 17, 5], [40, 2, 9, 11]]


def _greedy_next(policy: PolicyEngine, sequence: list[int]) -> int:
    with torch.no_grad():
        logits = policy.model(torch.tensor([sequence]))[-1, 0, :128]
    return int(logits.argmax())


def _engine(policy: PolicyEngine) -> RolloutEngine:
    return RolloutEngine(policy.model, vocab_size=128, max_positions=64)


def test_greedy_rollouts_follow_the_policy_and_its_updates():
    policy = PolicyEngine.from_args(ARGV)
    engine = _engine(policy)
    greedy = RolloutSampling(max_new_tokens=6, top_k=1)
    for update in range(2):
        rollouts = engine.generate(PROMPTS, group_size=2, sampling=greedy)
        assert len(rollouts.completions) == 4 and rollouts.generated_tokens == 24
        for prompt, completion in zip(rollouts.prompts, rollouts.completions, strict=True):
            sequence = list(prompt)
            for token in completion:
                assert token == _greedy_next(policy, sequence), f"update {update}"
                sequence.append(token)
        trainer = completion_logprobs(policy.logprobs({"tokens": rollouts.sequences}), rollouts)
        gap = logprob_gap(rollouts.inference_logprobs, trainer)
        assert gap["logprob_gap_max"] < 1e-4, gap
        # An update that pushes the generated tokens down: the next rollout must see it.
        batch = {"tokens": rollouts.sequences}
        policy.forward_backward(batch, lambda lps, b: sum(lp.sum() for lp in lps))
        policy.optimizer_step()


def test_sampled_rollouts_are_seeded_per_completion():
    policy = PolicyEngine.from_args(ARGV)
    engine = _engine(policy)
    sampling = RolloutSampling(max_new_tokens=8, temperature=1.0, seed=11)
    first = engine.generate(PROMPTS, group_size=3, sampling=sampling, step_seed=100)
    again = engine.generate(PROMPTS, group_size=3, sampling=sampling, step_seed=100)
    other = engine.generate(PROMPTS, group_size=3, sampling=sampling, step_seed=200)
    assert first.completions == again.completions
    assert first.completions != other.completions
    assert len(set(map(tuple, first.completions[:3]))) > 1  # a group's completions differ
    trainer = completion_logprobs(policy.logprobs({"tokens": first.sequences}), first)
    assert logprob_gap(first.inference_logprobs, trainer)["logprob_gap_max"] < 1e-4


def test_kv_cache_lives_for_one_rollout():
    policy = PolicyEngine.from_args(ARGV)
    engine = _engine(policy)
    engine.generate(PROMPTS, group_size=2, sampling=RolloutSampling(max_new_tokens=3, top_k=1))
    assert engine.kv_cache is not None and engine.kv_cache() is None  # built for the rollout, freed after it


def test_compiled_rollouts_sample_what_the_eager_engine_samples_and_compile_once(monkeypatch):
    """``compile_backend``: rollouts decode on the static KV cache through the engine's forward
    compiled once (aot_eager here: the traced graph, no generated code, fast): the same sampled
    completions as the eager paged engine, before and after an optimizer step updates the shared
    parameters in place, with no compilation after the first rollout's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")  # counts the graphs it compiles
    wrapped = []  # torch.compile calls: one for the engine's life (a fresh one would compile again)
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: wrapped.append(args) or real_compile(*args, **kwargs))
    torch._dynamo.reset()
    policy = PolicyEngine.from_args(ARGV)
    eager = _engine(policy)
    engine = RolloutEngine(policy.model, vocab_size=128, max_positions=64, compile_backend=counter)
    sampling = RolloutSampling(max_new_tokens=8, temperature=1.0, seed=11)
    for step in range(3):
        got = engine.generate(PROMPTS, group_size=3, sampling=sampling, step_seed=100 * step)
        want = eager.generate(PROMPTS, group_size=3, sampling=sampling, step_seed=100 * step)
        assert got.completions == want.completions, step
        assert logprob_gap(got.inference_logprobs, want.inference_logprobs)["logprob_gap_max"] < 1e-5
        if step == 0:
            first = counter.frame_count
            assert first >= 1
        assert counter.frame_count == first, step  # compiled in the first rollout, and never again
        policy.forward_backward({"tokens": got.sequences}, lambda lps, b: sum(lp.sum() for lp in lps))
        policy.optimizer_step()
    assert len(wrapped) == 1
    assert policy.model.training  # back in training mode after every rollout
