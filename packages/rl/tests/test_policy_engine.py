"""The orchestrator API (``mega.rl.policy_engine.PolicyEngine``) driven by a loss written here.

CPU: one process, and a dp2 gloo world (the rank forkserver of mega.testing) for the
data-parallel step (pinned: the engine builds on the CPU when no accelerator is asked for, and
these tests move nothing to one). The log-probabilities and the
weights are checked against ``transformers``' LlamaForCausalLM loaded from ``named_hf_tensors()``;
the gradient against autograd on the same loss computed sequence by sequence.
"""

from __future__ import annotations

import os

import pytest
import torch

from mega.rl.policy_engine import PolicyEngine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ARGV = ["--model-family", "llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "128",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2", "--eval-iters", "0", "--seed", "5",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "10"]


def batch_of(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    lengths = [5, 9, 3, 12, 7]
    tokens = [torch.randint(0, 128, (n,), generator=generator) for n in lengths]
    weights = [torch.randn(n - 1, generator=generator) for n in lengths]
    return {"tokens": tokens, "weights": weights}


def weighted_loss(logprobs: list[torch.Tensor], batch: dict) -> torch.Tensor:
    """A loss written for the test: minus the weighted log-likelihood, summed, over a constant."""
    return -sum((lp * w).sum() for lp, w in zip(logprobs, batch["weights"], strict=True)) / 40.0


def separate_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """One sequence alone through the model (no packing): log p(token t+1 | tokens <= t)."""
    logits = model(tokens[None])[:, 0].float()  # [s, 1, v] -> [s, v]
    return torch.log_softmax(logits[:-1, :128], -1).gather(-1, tokens[1:, None])[:, 0]


@pytest.fixture(scope="module")
def engine() -> PolicyEngine:
    torch.manual_seed(0)
    return PolicyEngine.from_args(ARGV)


def test_packed_logprobs_equal_each_sequence_alone(engine):
    batch = batch_of()
    packed = engine.logprobs(batch)
    with torch.no_grad():
        for tokens, got in zip(batch["tokens"], packed, strict=True):
            torch.testing.assert_close(got, separate_logprobs(engine.model, tokens), rtol=1e-5, atol=1e-5)


def test_named_hf_tensors_load_into_transformers_and_agree(engine):
    transformers = pytest.importorskip("transformers")
    names, tensors = [], {}
    for name, tensor in engine.named_hf_tensors():
        names.append(name)
        tensors[name] = tensor.clone()
    config = transformers.LlamaConfig(**engine.trainer.family.hf_mapping.config_to_hf(engine.trainer.run.model))
    hf = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(names), (missing, unexpected)
    batch = batch_of(1)
    ours = engine.logprobs(batch)
    with torch.no_grad():
        for tokens, got in zip(batch["tokens"], ours, strict=True):
            logits = hf(tokens[None]).logits[0]
            want = torch.log_softmax(logits[:-1], -1).gather(-1, tokens[1:, None])[:, 0]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_forward_backward_gradient_is_the_callers_loss(engine):
    batch = batch_of(2)
    params = [p for p in engine.model.parameters() if p.requires_grad]
    # Autograd on the same loss, each sequence through the model alone (no packing, no schedule).
    logprobs = [separate_logprobs(engine.model, tokens) for tokens in batch["tokens"]]
    expected = torch.autograd.grad(weighted_loss(logprobs, batch), params)
    engine.zero_grad()
    losses = engine.forward_backward(batch, weighted_loss)
    assert len(losses) == 3  # five sequences in micro-batches of two
    for param, want in zip(params, expected, strict=True):
        got = param.main_grad if getattr(param, "main_grad", None) is not None else param.grad
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    before = [p.detach().clone() for p in params]
    step = engine.optimizer_step()
    assert step["applied"] and engine.iteration == 1
    assert all(not torch.equal(a, b) for a, b in zip(before, params, strict=True))


def _state(engine) -> list[torch.Tensor]:
    inner = engine.trainer.optimizer.optimizer
    tensors = [p.detach().clone() for p in engine.model.parameters()]
    for state in inner.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def test_offload_onload_round_trip(engine):
    engine.forward_backward(batch_of(3), weighted_loss)
    engine.optimizer_step()  # optimizer state exists
    engine.forward_backward(batch_of(4), weighted_loss)  # gradients held across the offload
    grads = [b.grad_data.clone() for b in engine.chunk.grad_buffers]
    before = _state(engine)
    engine.offload()
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="twice"):
        engine.offload()
    engine.onload()
    for a, b in zip(before, _state(engine), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(grads, (b.grad_data for b in engine.chunk.grad_buffers), strict=True):
        assert torch.equal(a, b)
    engine.optimizer_step()  # the restored views still feed the optimizer


def test_save_then_load_continues_exactly(engine, tmp_path):
    engine.save(tmp_path)
    iteration = engine.iteration
    engine.forward_backward(batch_of(5), weighted_loss)
    engine.optimizer_step()
    continued = [p.detach().clone() for p in engine.model.parameters()]

    fresh = PolicyEngine.from_args(ARGV + ["--seed", "9"])  # other initial weights, overwritten by the load
    fresh.load(tmp_path)
    assert fresh.iteration == iteration
    fresh.forward_backward(batch_of(5), weighted_loss)
    fresh.optimizer_step()
    for a, b in zip(continued, fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bad_batch_is_named(engine):
    batch = batch_of()
    batch["weights"] = batch["weights"][:2]
    with pytest.raises(ValueError, match="batch\\['weights'\\] has 2 entries for 5 sequences"):
        engine.forward_backward(batch, weighted_loss)


def _dp_rank_step(argv: list[str], seed: int) -> dict:
    """On each rank of a gloo world: this rank's half of the batch, one forward-backward and step."""
    import torch.distributed as dist

    policy = PolicyEngine.from_args(argv)
    rank, size = dist.get_rank(), dist.get_world_size()
    batch = batch_of(seed)
    share = {key: values[rank::size] for key, values in batch.items()}
    policy.forward_backward(share, weighted_loss)
    grads = [(p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).clone()
             for p in policy.model.parameters()]
    policy.optimizer_step()
    return {"grads": grads, "params": [p.detach().clone() for p in policy.model.parameters()]}


def test_data_parallel_step_equals_one_process(worlds):
    """dp2 on gloo (CPU): the gradient is the mean of the ranks' (the documented averaging), so one
    process running the whole batch with the loss halved takes the same step."""
    argv = [*ARGV[:ARGV.index("--global-batch-size")], "--global-batch-size", "4",
            *ARGV[ARGV.index("--global-batch-size") + 2:]]
    ranks = worlds.run(2, _dp_rank_step, argv, 7)
    single = PolicyEngine.from_args(argv)
    single.forward_backward(batch_of(7), lambda lps, b: weighted_loss(lps, b) / 2)
    grads = [(p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).clone()
             for p in single.model.parameters()]
    single.optimizer_step()
    for result in ranks:
        for got, want in zip(result["grads"], grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        # Adam divides by sqrt(v): an element whose gradient is near 0 turns summation-order
        # noise into ~1e-6 of its lr 1e-2 step; 1e-5 is a thousandth of the step.
        for got, want in zip(result["params"], single.model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
