"""The KL reference (``mega.rl.reference``): a frozen copy of the initial policy, or under LoRA the
same model with its adapters switched off.

CPU here, one process; the engines take the machine's device and every comparison is between
tensors of one device, so it runs on a GPU machine too. The reference is checked against a policy built afresh from the
same seed (the initial weights, which the trainer never touched) and, under LoRA, against the
base model built without adapters.
"""

from __future__ import annotations

import pytest
import torch

from mega.models.lora.adapters import adapters_disabled
from mega.rl.grpo_step import GRPOSettings, grpo_step
from mega.rl.policy_engine import PolicyEngine
from mega.rl.reference import AdaptersOff, FrozenCopy, reference_for
from mega.rl.rollouts import RolloutEngine, RolloutSampling

ARGV = ["--model-family", "llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "128",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-2", "--eval-iters", "0", "--seed", "5",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "100"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]


def batch_of(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"tokens": [torch.randint(0, 128, (n,), generator=generator) for n in (5, 9, 3, 12)]}


def likelihood_step(policy: PolicyEngine) -> None:
    """One optimizer step raising the likelihood of a batch: the policy moves away from where it started."""
    policy.forward_backward(batch_of(1), lambda logprobs, micro: -sum(lp.sum() for lp in logprobs) / 40)
    policy.optimizer_step()


@pytest.fixture(scope="module")
def initial() -> list[torch.Tensor]:
    """The log-probabilities of a policy built afresh (the weights every policy below starts from)."""
    return PolicyEngine.from_args(ARGV).logprobs(batch_of())


def test_frozen_copy_stays_the_initial_policy(initial, tmp_path):
    policy = PolicyEngine.from_args(ARGV)
    assert reference_for(policy, 0.0) is None  # no KL term: nothing kept
    reference = reference_for(policy, 0.1)
    assert isinstance(reference, FrozenCopy)
    weights = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    assert reference.nbytes >= weights and all(not copy.requires_grad for _, _, copy in reference.pairs)
    for _ in range(2):
        likelihood_step(policy)
    moved = policy.logprobs(batch_of())
    assert not torch.equal(torch.cat(moved), torch.cat(initial))
    for got, want in zip(reference.logprobs(policy, batch_of()), initial, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the policy has its own weights back, bit for bit
    for got, want in zip(policy.logprobs(batch_of()), moved, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="has no rl_reference/"):
        reference.load(tmp_path)  # a checkpoint of a run without a KL term


def test_lora_reference_is_the_base_model_with_adapters_off(initial):
    policy = PolicyEngine.from_args([*ARGV, *LORA])
    reference = reference_for(policy, 0.1)
    assert isinstance(reference, AdaptersOff) and reference.nbytes == 0
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    for _ in range(2):
        likelihood_step(policy)
    changed = {name for name, p in policy.model.named_parameters() if not torch.equal(p, before[name])}
    adapters = {name for name in before if ".adapter." in name}
    assert changed and changed <= adapters  # only adapters train
    assert not torch.equal(torch.cat(policy.logprobs(batch_of())), torch.cat(initial))
    for got, want in zip(reference.logprobs(policy, batch_of()), initial, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with adapters_disabled(policy.model) as switched:  # nested: each layer gets its own setting back
        assert switched == 4 * 2
        with adapters_disabled(policy.model):
            pass
        torch.testing.assert_close(torch.cat(policy.logprobs(batch_of())), torch.cat(initial), rtol=1e-6, atol=1e-6)
    assert not torch.equal(torch.cat(policy.logprobs(batch_of())), torch.cat(initial))


def low_token_fraction(rollouts) -> torch.Tensor:
    return torch.tensor([sum(t < 16 for t in c) / max(len(c), 1) for c in rollouts.completions])


@pytest.mark.parametrize("lora", [False, True], ids=["copy", "lora"])
def test_kl_term_in_the_step(lora):
    policy = PolicyEngine.from_args([*ARGV, *(LORA if lora else [])])
    engine = RolloutEngine(policy.model, vocab_size=128, max_positions=64)
    settings = GRPOSettings(group_size=4, global_batch_size=8, kl_beta=0.1)
    with pytest.raises(ValueError, match="needs a reference policy"):
        grpo_step(policy, engine, [[20, 21, 22]] * 4, low_token_fraction, settings, RolloutSampling(4), 0)
    reference = reference_for(policy, settings.kl_beta)
    prompts = [[20 + i, 40 + i, 60 + i] for i in range(4)]
    logs = [grpo_step(policy, engine, prompts, low_token_fraction, settings, RolloutSampling(max_new_tokens=4, seed=1),
                      step_seed=100 * step, reference=reference) for step in range(2)]
    # k3 >= 0: zero while the policy is still the reference (the first of a step's two optimizer steps sees
    # cur = ref exactly), then growing as it moves away
    assert 0.0 < logs[0]["kl"] < logs[1]["kl"]
