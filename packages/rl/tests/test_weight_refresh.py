"""The engine on its own layout, refreshed from the training layout without disk (issue 48's
refresh acceptance).

CPU, one gloo world of 4 ranks (the rank forkserver of mega.testing; pinned: the trainer and the
engine build on the CPU when no accelerator is asked for, and nothing here moves to one). After
three GRPO steps (rollouts by the engine, rewards, updates on the training layout, refresh), the
engine's greedy tokens and log-probabilities equal, exactly, those of an engine loaded fresh by
the inference loader from a checkpoint the trainer saved at that step; and they moved from the
first step's (a stale engine would fail).
"""

from __future__ import annotations

import torch

from mega.rl.grpo_step import GRPOSettings, grpo_step
from mega.rl.policy_engine import PolicyEngine
from mega.rl.rollouts import RolloutEngine, RolloutSampling, build_rollout_engine

ARGV = ["--model-family", "llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "128",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-2", "--eval-iters", "0", "--seed", "5",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "10"]
PROMPTS = [[3, 17, 5], [40, 2, 9, 11], [7, 7], [100, 64, 1, 90, 33]]
SAMPLING = RolloutSampling(max_new_tokens=4, temperature=1.0, seed=3)
GREEDY = RolloutSampling(max_new_tokens=5, top_k=1)


def _low_tokens(rollouts) -> torch.Tensor:
    """The reward: the fraction of completion tokens below 64."""
    return torch.tensor([sum(t < 64 for t in c) / max(len(c), 1) for c in rollouts.completions])


def _greedy(engine: RolloutEngine) -> tuple[list, list]:
    rollouts = engine.generate(PROMPTS[:2], 1, GREEDY)
    return rollouts.completions, rollouts.inference_logprobs


def _refreshed_against_checkpoint(train_flags: list[str], engine_tp: int, save: str, offload: bool = False) -> dict:
    """On each rank: three GRPO steps with the engine at ``engine_tp`` (the optimizer state in host
    memory during rollouts with ``offload``), then the engine's greedy rollouts beside those of
    an engine loaded from a checkpoint of the same step."""
    from mega.inference.loader import load_model

    policy = PolicyEngine.from_args(ARGV + train_flags)
    engine = build_rollout_engine(policy, engine_tp)
    before = _greedy(engine)
    settings = GRPOSettings(group_size=2, global_batch_size=8)
    logs = [grpo_step(policy, engine, PROMPTS, _low_tokens, settings, SAMPLING, step_seed=1000 * step,
                      offload_optimizer=offload) for step in range(3)]
    refreshed = _greedy(engine)
    policy.save(save)
    groups = engine.weight_sync.engine_groups
    loaded = load_model(save, groups=groups, device=groups.device)
    fresh = RolloutEngine(loaded.model, vocab_size=128, max_positions=64, tp_group=groups.tp, replicas=groups.dp)
    return {"iteration": policy.iteration, "before": before, "refreshed": refreshed, "fresh": _greedy(fresh),
            "refresh_s": [log["refresh_s"] for log in logs], "shares": engine.shares_trainer_weights}


def _check(ranks: list[dict]) -> None:
    for result in ranks:
        assert result["iteration"] == 3 and not result["shares"]
        assert all(seconds > 0 for seconds in result["refresh_s"])
        tokens, logprobs = result["refreshed"]
        fresh_tokens, fresh_logprobs = result["fresh"]
        assert tokens == fresh_tokens
        for got, want in zip(logprobs, fresh_logprobs, strict=True):
            assert torch.equal(got, want)
        moved = max((a - b).abs().max().item() for a, b in zip(result["before"][1], logprobs, strict=True))
        assert moved > 1e-3, "the updates did not change the engine's log-probabilities"
        assert tokens == ranks[0]["refreshed"][0]


def test_fsdp2_dp2_training_refreshes_a_tp1_engine(worlds, tmp_path):
    """FSDP2 over dp2 (times tp2: four ranks) trains, its sharded optimizer state offloaded during
    rollouts; the engine has tp1 and four replicas."""
    _check(worlds.run(4, _refreshed_against_checkpoint, ["--tensor-model-parallel-size", "2", "--use-torch-fsdp2"],
                      1, str(tmp_path / "fsdp"), offload=True))


def test_tp2_pp2_training_refreshes_a_tp2_engine(worlds, tmp_path):
    """Training at tp2 x pp2; the engine at tp2 holds both stages' layers, two replicas of it."""
    _check(worlds.run(4, _refreshed_against_checkpoint,
                      ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2, str(tmp_path / "pp")))


def _lora_policy_engines(steps: int) -> dict:
    """On each rank: a LoRA policy trained at tp2 x dp2 with rollouts from an engine of its own at
    tp1 (refreshed with the adapted weights merged), beside an engine on the trainer's own module
    (the adapters live): greedy rollouts of both after the steps."""
    policy = PolicyEngine.from_args(ARGV + ["--tensor-model-parallel-size", "2", "--lora-rank", "4", "--lora-alpha", "8"])
    own, shared = build_rollout_engine(policy, 1), build_rollout_engine(policy)
    before = _greedy(own)
    settings = GRPOSettings(group_size=2, global_batch_size=8)
    logs = [grpo_step(policy, own, PROMPTS, _low_tokens, settings, SAMPLING, step_seed=100 * step)
            for step in range(steps)]
    return {"shares": (own.shares_trainer_weights, shared.shares_trainer_weights), "before": before,
            "own": _greedy(own), "shared": _greedy(shared), "logs": logs}


def test_a_lora_policy_refreshes_an_engine_of_its_own_layout(worlds):
    """LoRA at tp2 x dp2 (four ranks), the engine at tp1: it holds no adapters, so each refresh
    brings the adapted layers' weights merged (W + B A * alpha / rank). After three steps its greedy
    tokens equal those of an engine on the trainer's own module (base and adapters computed apart)
    and its log-probabilities agree (fp32; the merge rounds apart); the trainer sees its rollouts'
    log-probabilities as it does (the logged gap)."""
    for result in worlds.run(4, _lora_policy_engines, 3):
        assert result["shares"] == (False, True)
        tokens, logprobs = result["own"]
        assert tokens == result["shared"][0]
        for got, want in zip(logprobs, result["shared"][1], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        moved = max((a - b).abs().max().item() for a, b in zip(result["before"][1], logprobs, strict=True))
        assert moved > 1e-3, "the updates (adapters only) did not reach the engine"
        assert all(log["logprob_gap_max"] < 1e-4 for log in result["logs"]), result["logs"]


def _mega_rl(argv: list[str]) -> list[dict]:
    import multiprocessing

    from mega.rl.command import run_rl

    # The world's ranks are daemonic processes, which multiprocessing forbids children; the reward
    # pool's workers are children the pool itself ends before run_rl returns.
    multiprocessing.current_process()._config.pop("daemon", None)
    return run_rl(argv)


def test_mega_rl_on_four_ranks(worlds, tmp_path):
    """`mega rl` on 4 ranks: dp4 with the distributed optimizer trains, a tp2 engine (two
    replicas, each scoring its own completions) generates, the optimizer state waits in host
    memory during rollouts. The engine-vs-trainer gap of the second step is the refreshed
    engine's against the updated trainer."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{a} {b} {c}", "length_scale": 20}}\n'
                               for a, b, c in [(20, 31, 45), (99, 17, 60), (70, 70, 21), (33, 18, 104)]))
    argv = [*ARGV[:ARGV.index("--vocab-size")], "--vocab-size", "127", "--tokenizer-type", "NullTokenizer",
            *ARGV[ARGV.index("--vocab-size") + 2:], "--use-distributed-optimizer",
            "--rl-inference-tensor-model-parallel-size", "2", "--rl-offload-optimizer-during-inference",
            "--prompt-data", str(prompts), "--reward", "length", "--reward-workers", "1", "--grpo-group-size", "2",
            "--grpo-prompts-per-step", "4", "--rl-max-new-tokens", "4", "--train-iters", "2"]
    ranks = worlds.run(4, _mega_rl, argv)
    for logs in ranks:
        assert [log["iteration"] for log in logs] == [1, 2]
        assert [log["reward_mean"] for log in logs] == [log["reward_mean"] for log in ranks[0]]
        assert all(log["refresh_s"] > 0 for log in logs)
        assert logs[1]["logprob_gap_max"] < 1e-4, logs[1]
        assert logs[0]["reward_counts"]["length"]["calls"] == 8  # once per completion, over both replicas


def test_optimizer_offload_keeps_the_parameters():
    """One process: ``offload(parameters=False)`` (--rl-offload-optimizer-during-inference) empties
    the optimizer state and gradient buffers, leaves the parameters (the engine may generate from
    them), and ``onload`` brings everything back bit for bit."""
    policy = PolicyEngine.from_args(ARGV)
    batch = {"tokens": [torch.tensor(p + p) for p in PROMPTS]}
    policy.forward_backward(batch, lambda lps, b: -sum(lp.sum() for lp in lps))
    policy.optimizer_step()  # the optimizer state exists
    state = [v for s in policy.trainer.optimizer.optimizer.state.values() for v in s.values() if v.dim() > 0]
    saved = [t.clone() for t in state]
    params = [p.detach().clone() for p in policy.model.parameters()]
    logprobs = policy.logprobs(batch)
    policy.offload(parameters=False)
    assert all(t.untyped_storage().nbytes() == 0 for t in state)
    assert all(b.grad_data.untyped_storage().nbytes() == 0 for b in policy.chunk.grad_buffers)
    for got, want in zip(policy.logprobs(batch), logprobs, strict=True):  # the parameters stayed
        assert torch.equal(got, want)
    policy.onload()
    assert all(torch.equal(a, b) for a, b in zip(state, saved, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(policy.model.parameters(), params, strict=True))


def _shared_engine_gap(steps: int) -> dict:
    """On each rank: tp2 x dp2 training, the engine at the same tp on the trainer's own module."""
    policy = PolicyEngine.from_args(ARGV + ["--tensor-model-parallel-size", "2"])
    engine = build_rollout_engine(policy)
    settings = GRPOSettings(group_size=2, global_batch_size=8)
    logs = [grpo_step(policy, engine, PROMPTS, _low_tokens, settings, SAMPLING, step_seed=step)
            for step in range(steps)]
    return {"shares": engine.shares_trainer_weights, "logs": logs}


def test_engine_at_the_training_layout_shares_the_trainers_parameters(worlds):
    """tp2 x dp2 training with the engine at tp2: no copy, nothing to refresh, and the second
    step's rollouts (after an update) agree with the trainer's log-probabilities."""
    for result in worlds.run(4, _shared_engine_gap, 2):
        assert result["shares"]
        assert [log["refresh_s"] for log in result["logs"]] == [0.0, 0.0]
        assert result["logs"][1]["logprob_gap_max"] < 1e-4, result["logs"][1]


def test_an_engine_size_that_does_not_divide_the_world_is_named(tmp_path, capsys):
    from mega.rl.command import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "20 31 45"}\n')
    argv = [*ARGV[:ARGV.index("--vocab-size")], "--vocab-size", "127", "--tokenizer-type", "NullTokenizer",
            *ARGV[ARGV.index("--vocab-size") + 2:], "--prompt-data", str(prompts), "--reward", "length",
            "--grpo-prompts-per-step", "4", "--grpo-group-size", "2", "--rl-max-new-tokens", "4",
            "--rl-inference-tensor-model-parallel-size", "2"]
    assert main(argv) == 2
    assert "--rl-inference-tensor-model-parallel-size 2 does not divide the 1 ranks" in capsys.readouterr().err
