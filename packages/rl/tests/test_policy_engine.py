"""The orchestrator API (``mega.rl.policy_engine.PolicyEngine``) driven by a loss written here.

CPU: one process, and one 2-rank gloo world (the rank forkserver of mega.testing) for every
layout (pinned: ``cpu_only`` hides CUDA from the one-process engines, and gloo ranks build on
the CPU). The log-probabilities and the weights are checked against
``transformers``' LlamaForCausalLM loaded from ``named_hf_tensors()``; the gradient against
autograd on the same loss computed sequence by sequence.

Layouts: one GRPO update on fixed rollouts made here (token sequences, prompt lengths, group
advantages, old log-probabilities; no engine), with the GRPO loss of :mod:`mega.rl.loss`
(clip-higher, token-mean over the whole batch) through ``forward_backward`` and
``optimizer_step``, at tp2 + sp, pp2 (1F1B and zero bubble), dp2 with the distributed optimizer,
FSDP2 dp2 and ep2 (Mixtral): the log-probabilities before and after the update and the full
parameters after it (gathered by :mod:`mega.rl.full_tensors`) equal one process's on the whole
batch (fp32, 1e-5), on every rank; ``named_hf_tensors()`` at tp2 and pp2 equals one process's exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

from mega.rl.advantages import group_advantages
from mega.rl.full_tensors import full_named_tensors
from mega.rl.loss import aggregate, grpo_token_losses
from mega.rl.policy_engine import PolicyEngine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ARGV = ["--model-family", "llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "128",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2", "--eval-iters", "0", "--seed", "5",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "10"]


@pytest.fixture(scope="module", autouse=True)
def cpu_only():
    """One-process engines build on the CPU, as the gloo ranks do, on a GPU machine too (a lone
    process takes CUDA where torch has it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        yield


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
    with pytest.raises(ValueError, match="the batch has no sequences"):
        engine.logprobs({"tokens": []})


def test_named_hf_tensors_of_a_lora_policy_are_merged():
    """A LoRA policy after an update (only its adapters trained): its Hugging Face tensors carry
    the adapted layers merged, and transformers' LLaMA loaded from them gives the policy's
    log-probabilities (the adapters computed apart in mega, merged in transformers)."""
    transformers = pytest.importorskip("transformers")
    policy = PolicyEngine.from_args(ARGV + ["--lora-rank", "4", "--lora-alpha", "8"])
    policy.forward_backward(batch_of(3), weighted_loss)
    assert policy.optimizer_step()["applied"]
    tensors = {name: tensor.clone() for name, tensor in policy.named_hf_tensors()}
    assert not any("lora" in name or "adapter" in name for name in tensors)
    config = transformers.LlamaConfig(**policy.trainer.family.hf_mapping.config_to_hf(policy.trainer.run.model))
    hf = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    batch = batch_of(1)
    with torch.no_grad():
        for tokens, got in zip(batch["tokens"], policy.logprobs(batch), strict=True):
            logits = hf(tokens[None]).logits[0]
            want = torch.log_softmax(logits[:-1], -1).gather(-1, tokens[1:, None])[:, 0]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        base = PolicyEngine.from_args(ARGV + ["--lora-rank", "4", "--lora-alpha", "8"])
        unmerged = base.logprobs(batch)  # the same base weights (seed), adapters untrained
        assert max((a - b).abs().max() for a, b in zip(policy.logprobs(batch), unmerged, strict=True)) > 1e-4


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


# -- layouts ---------------------------------------------------------------------------------
def _flags(argv: list[str], **values: str) -> list[str]:
    """``argv`` with the values of some flags replaced (``lr="1e-3"`` for ``--lr``)."""
    argv = list(argv)
    for name, value in values.items():
        argv[argv.index("--" + name.replace("_", "-")) + 1] = value
    return argv


# Adam's first step is lr * sign(gradient) where a gradient is far from 0; where it is near 0 the
# layouts' summation orders differ in its sign: lr 1e-3 keeps that noise under the 1e-5 compared.
LLAMA = _flags(ARGV, lr="1e-3")
# No router auxiliary loss in the layouts' comparison: it is each rank's over its own share's
# tokens (test_a_moe_policy_trains_its_routers_auxiliary_losses), not one process's over the batch.
MIXTRAL = ["--model-family", "mixtral", "--model-preset", "tiny", *LLAMA[LLAMA.index("--num-attention-heads"):],
           "--moe-aux-loss-coeff", "0"]
# name -> (model, layout flags); data-parallel layouts give each rank its own share of the rollouts
LAYOUTS = {
    "tp2-sp": (LLAMA, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (LLAMA, ["--pipeline-model-parallel-size", "2"]),
    # Zero bubble: the last stage hands the loss its hidden states and the output weight (W later).
    "pp2-zb-h1": (LLAMA, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]),
    "dp2-distributed-optimizer": (LLAMA, ["--use-distributed-optimizer"]),
    "dp2-fsdp2": (LLAMA, ["--use-torch-fsdp2"]),
    "ep2-mixtral": (MIXTRAL, ["--expert-model-parallel-size", "2"]),
}
GROUP_SIZE = 3


def rollouts() -> dict:
    """Two prompts, three completions each: tokens, prompt lengths, advantages, old log-probabilities."""
    generator = torch.Generator().manual_seed(11)
    prompt_lengths = [4, 4, 4, 6, 6, 6]
    completion_lengths = [5, 9, 3, 7, 2, 11]
    prompts = [torch.randint(0, 128, (4,), generator=generator), torch.randint(0, 128, (6,), generator=generator)]
    tokens = [torch.cat([prompts[i // GROUP_SIZE], torch.randint(0, 128, (n,), generator=generator)])
              for i, n in enumerate(completion_lengths)]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0])
    # Near a fresh tiny model's log-probabilities (about -log 128), so some ratios leave the clip range.
    old = [-4.85 + 0.15 * torch.randn(n, generator=generator) for n in completion_lengths]
    return {"tokens": tokens, "prompt_length": prompt_lengths,
            "advantage": list(group_advantages(rewards, GROUP_SIZE)), "old": old}


def grpo_update(policy: PolicyEngine, batch: dict) -> None:
    """One optimizer step with the GRPO loss, token-mean over the whole batch of every
    data-parallel rank (the engine means the ranks' gradients: normalised as verl's agg_loss)."""
    total_tokens = policy.data_parallel_sum(sum(len(o) for o in batch["old"]))
    pad = torch.nn.utils.rnn.pad_sequence

    def loss_fn(logprobs, micro):
        current = [lp[n - 1:] for lp, n in zip(logprobs, micro["prompt_length"], strict=True)]
        terms = grpo_token_losses(pad(current, batch_first=True), pad(micro["old"], batch_first=True),
                                  torch.stack(micro["advantage"]), clamp_eps_lower=0.2, clamp_eps_upper=0.28)
        mask = pad([torch.ones(len(c)) for c in current], batch_first=True)
        return aggregate(terms.loss, mask, total_tokens=total_tokens) * policy.data_parallel_size

    policy.forward_backward(batch, loss_fn)
    assert policy.optimizer_step()["applied"]


def run_update(argv: list[str], hf: bool) -> dict:
    """On each rank (or in one process): the update on this data-parallel rank's share."""
    policy = PolicyEngine.from_args(argv)
    dp = policy.groups.dp
    batch = {key: values[dp.rank::dp.size] for key, values in rollouts().items()}
    # (Clones: where nothing is split, the full tensors are the parameters themselves.)
    hf_tensors = {name: tensor.clone() for name, tensor in policy.named_hf_tensors()} if hf else None
    result = {"hf": hf_tensors, "before": policy.logprobs(batch)}
    grpo_update(policy, batch)
    result["after"] = policy.logprobs(batch)
    result["params"] = {name: tensor.clone() for name, tensor in full_named_tensors(policy.trainer)}
    return result


@pytest.fixture(scope="module")
def one_process() -> dict:
    references = {model[1]: run_update(model, hf=True) for model in (LLAMA, MIXTRAL)}
    for reference in references.values():  # the update moves the log-probabilities well past 1e-5
        assert max((a - b).abs().max() for a, b in zip(reference["after"], reference["before"], strict=True)) > 1e-3
    return references


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grpo_update_at_layout_equals_one_process(worlds, one_process, layout):
    model, flags = LAYOUTS[layout]
    expected = one_process[model[1]]
    exact_hf = layout in ("tp2-sp", "pp2")
    data_parallel = layout.startswith(("dp2", "ep2"))
    ranks = worlds.run(2, run_update, [*model, *flags], exact_hf)
    for rank, result in enumerate(ranks):
        mine = slice(rank, None, 2) if data_parallel else slice(None)
        for when in ("before", "after"):
            for got, want in zip(result[when], expected[when][mine], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert result["params"].keys() == expected["params"].keys()
        for name, want in expected["params"].items():
            torch.testing.assert_close(result["params"][name], want, rtol=1e-5, atol=1e-5)
        if exact_hf:
            assert list(result["hf"]) == list(expected["hf"])
            for name, want in expected["hf"].items():
                assert torch.equal(result["hf"][name], want), f"{layout} rank {rank}: {name}"


def test_a_moe_policy_trains_its_routers_auxiliary_losses():
    """One process. A Mixtral policy's gradient is that of the caller's loss plus its routers'
    load-balancing and z-losses times --moe-aux-loss-coeff and --moe-z-loss-coeff, each
    micro-batch's averaged over the micro-batches (Megatron's rule): autograd on that sum, each
    sequence's log-probabilities and each packed micro-batch's statistics from the model called
    directly (no pipeline schedule)."""
    from mega.models.mixtral.model import MOE_STATS

    aux, z = 0.1, 0.01
    policy = PolicyEngine.from_args([*MIXTRAL[:-2], "--moe-aux-loss-coeff", str(aux), "--moe-z-loss-coeff", str(z)])
    batch = batch_of(2)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    micro = policy._micro_batches(batch)
    logprobs = [separate_logprobs(policy.model, tokens) for tokens in batch["tokens"]]
    stats = [policy.model(inputs)[MOE_STATS] for inputs, _ in micro]
    auxiliary = sum(aux * s[:, 0].sum() + z * s[:, 1].sum() for s in stats) / len(micro)
    expected = torch.autograd.grad(weighted_loss(logprobs, batch) + auxiliary, params)
    without = torch.autograd.grad(weighted_loss([separate_logprobs(policy.model, tokens)
                                                 for tokens in batch["tokens"]], batch), params)
    routers = [i for i, (name, p) in enumerate(policy.model.named_parameters()) if p.requires_grad and "router" in name]
    assert routers and all(not torch.allclose(expected[i], without[i]) for i in routers)  # the losses count
    policy.zero_grad()
    policy.forward_backward(batch, weighted_loss)
    for param, want in zip(params, expected, strict=True):
        got = param.main_grad if getattr(param, "main_grad", None) is not None else param.grad
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def _uneven_expert_shares(argv: list[str]) -> str:
    """Rank 0 passes three sequences (two micro-batches), rank 1 one (one): the error, on each rank."""
    policy = PolicyEngine.from_args(argv)
    batch = rollouts()
    picked = [0, 1, 2] if policy.groups.dp.rank == 0 else [3]
    try:
        policy.logprobs({key: [values[i] for i in picked] for key, values in batch.items()})
    except ValueError as error:
        return str(error)
    return "no error"


def test_uneven_shares_under_expert_parallelism_are_named(worlds):
    model, flags = LAYOUTS["ep2-mixtral"]
    messages = worlds.run(2, _uneven_expert_shares, [*model, *flags])
    assert messages == ["under expert parallelism every data-parallel rank passes as many micro-batches (of "
                        f"--micro-batch-size sequences): this rank has {mine}, another {other}"
                        for mine, other in ((2, 1), (1, 2))]
