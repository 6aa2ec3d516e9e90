"""``mega rl``: GRPO post-training on mega's trainer and engine, on one rank or many.

    mega rl --load CKPT --tokenizer-type ... --prompt-data prompts.jsonl --reward math \\
            --grpo-group-size 8 --grpo-prompts-per-step 32 --rl-max-new-tokens 512 \\
            --global-batch-size 64 --train-iters 200 --save out/
    mega rl --nproc-per-node 4 --tensor-model-parallel-size 2 --rl-inference-tensor-model-parallel-size 1 ...
    torchrun --nproc-per-node 4 -m mega.core.cli.main rl ...

Takes ``mega train``'s flags (the model, optimizer, precision, checkpoints; ``--train-iters``
counts optimizer steps, ``--global-batch-size`` sequences per optimizer step) and the RL flags
(mega.rl.config). Each GRPO step: the next ``--grpo-prompts-per-step`` prompts ->
``--grpo-group-size`` completions each from the engine -> rewards -> advantages -> old
log-probabilities by the trainer (and the KL reference's, ``--grpo-kl-beta``) ->
``--grpo-iterations`` passes of optimizer steps -> refresh; one log line per step (rank 0's).
With ``--rl-dynamic-sampling`` a step draws more rounds of prompts until its groups carry signal.
``--save`` checkpoints carry the prompt position (``rl_state.json``) and the reference
(``rl_reference/``), and ``--load`` of one continues exactly (the rollout seeds follow from the
step).

On several ranks (``--nproc-per-node N``, started as ``mega train`` starts them, or torchrun)
every rank holds the trainer's layout and an engine at ``--rl-inference-tensor-model-parallel-size``
(mega.rl.rollouts): the engine's replicas split the prompts, each replica's first rank scores its
completions in its reward pool, and the update runs on the training layout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mega.core.checkpoint.directory import iteration_name, read_tracker
from mega.core.config import ConfigError, add_section
from mega.core.plugins import PluginError, get_plugins
from mega.core.process_group import init_distributed
from mega.rl.config import RLConfig
from mega.rl.grpo_step import GRPOSettings, grpo_step
from mega.rl.policy_engine import PolicyEngine
from mega.rl.prompts import PromptDataError, PromptIterator, prompt_chat_template, read_prompt_data
from mega.rl.reference import reference_for
from mega.rl.rewards import RewardCounts, RewardPool, RewardSpecError, load_rewards, score
from mega.rl.rollouts import RolloutSampling, build_rollout_engine
from mega.rl.routing_replay import StepRouting
from mega.train.command import _without_launcher_flags
from mega.train.launch import launch_local
from mega.train.run_parser import launcher_parser, parse_run

STATE_FILE = "rl_state.json"
SEED_STRIDE = 2**20  # rollout seeds of step s: seed + s * SEED_STRIDE + i (i < completions per step)


def rl_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mega rl", add_help=False, allow_abbrev=False,
                                     description="GRPO post-training (Megatron-RL's flags) on mega's trainer and "
                                                 "engine in the same job; every `mega train` flag is accepted too, "
                                                 "--nproc-per-node N starts N local ranks")
    add_section(parser, "rl", RLConfig, title="reinforcement learning")
    return parser


def split_argv(argv: list[str]) -> tuple[RLConfig, list[str]]:
    """The RL section from ``argv``, and the rest (``mega train``'s flags)."""
    namespace, rest = rl_parser().parse_known_args(argv)
    values = {dest.split(".", 1)[1]: value for dest, value in vars(namespace).items() if dest.startswith("rl.")}
    return RLConfig(**values), rest


def run_rl(argv: list[str], plugins=None) -> list[dict]:
    """Run ``mega rl ARGV`` in this process (one rank of the job its environment describes, if
    any); the log of every GRPO step it took."""
    plugins = plugins or get_plugins()
    rl, rest = split_argv(argv)
    run, family = parse_run(rest, plugins)
    init_distributed(timeout_s=run.training.distributed_timeout_minutes * 60)
    if rl.prompt_data is None:
        raise ConfigError("mega rl needs --prompt-data FILE.jsonl")
    if not rl.rl_max_new_tokens:
        raise ConfigError("mega rl needs --rl-max-new-tokens (the longest completion a rollout generates)")
    policy = PolicyEngine.from_run(run, family, plugins)
    run, tokenizer = policy.trainer.run, policy.tokenizer
    if tokenizer is None:
        raise ConfigError("mega rl needs a tokenizer (--tokenizer-type ...): prompts are text")
    settings = GRPOSettings.from_config(rl, policy.trainer.derived.global_batch_size)
    completions = rl.grpo_prompts_per_step * rl.grpo_group_size
    if completions % settings.global_batch_size:
        raise ConfigError(f"--grpo-prompts-per-step x --grpo-group-size = {completions} completions per step is not "
                          f"a multiple of --global-batch-size {settings.global_batch_size}")
    steps_per_rollout = settings.iterations * completions // settings.global_batch_size
    if settings.dynamic_sampling and settings.max_sampling_rounds * completions > SEED_STRIDE:
        raise ConfigError(f"--rl-dynamic-sampling-max-rounds x {completions} completions exceeds the {SEED_STRIDE} "
                          "rollout seeds of a step")

    template = prompt_chat_template(rl.chat_template, run.data.tokenizer_model)
    prompts = PromptIterator(read_prompt_data(rl.prompt_data, template), seed=run.training.seed)
    rewards = load_rewards(rl.reward, plugins.rewards)
    if settings.routing_replay:
        StepRouting(policy)  # refuses a model without MoE layers, or one that recomputes them, before any rollout
    # The policy as loaded (before any update) is the reference; a resumed run's comes from its checkpoint.
    reference = reference_for(policy, rl.grpo_kl_beta)
    checkpoint = run.checkpoint
    if checkpoint.load and not checkpoint.finetune:
        _restore(checkpoint.load_adapter or checkpoint.load, policy, prompts, reference)
    engine = build_rollout_engine(policy, rl.rl_inference_tensor_model_parallel_size, tokenizer,
                                  compile_backend=rl.rl_inference_compile_backend)
    seed = rl.rl_seed if rl.rl_seed is not None else run.training.seed
    sampling = RolloutSampling(max_new_tokens=rl.rl_max_new_tokens, temperature=rl.rl_temperature, top_p=rl.rl_top_p,
                               top_k=rl.rl_top_k, stop_strings=tuple(rl.rl_stop),
                               stop_ids=frozenset({tokenizer.eod}), seed=seed)

    try:
        return _loop(rl, run, policy, engine, prompts, rewards, settings, sampling, steps_per_rollout, reference)
    finally:
        policy.close()


def _loop(rl, run, policy, engine, prompts, rewards, settings, sampling, steps_per_rollout, reference) -> list[dict]:
    tokenizer = policy.tokenizer
    logs = []
    train_iters, interval = run.training.train_iters, run.checkpoint.save_interval
    # Rewards run where the engine's replicas lead (each scores its own completions).
    scoring = engine.is_leader
    with RewardPool(rl.reward_workers, rl.reward_timeout) if scoring else contextlib.nullcontext() as pool:
        while policy.iteration < train_iters:
            step = policy.iteration // steps_per_rollout
            counts = {}

            def next_round(counts=counts):
                """The next prompts as token ids, and the reward function of their completions (a
                replica's share of them: ``rollouts.first_prompt`` says which)."""
                batch = prompts.next_batch(rl.grpo_prompts_per_step)

                def score_round(rollouts):
                    group = rl.grpo_group_size
                    share = batch[rollouts.first_prompt:rollouts.first_prompt + len(rollouts.completions) // group]
                    texts = [tokenizer.detokenize([t for t in c if t != tokenizer.eod]) for c in rollouts.completions]
                    scores = score(rewards, pool, [p.text for p in share for _ in range(group)], texts,
                                   [p.fields for p in share for _ in range(group)])
                    _add_counts(counts, scores.counts)
                    return torch.tensor(scores.total)

                return [tokenizer.tokenize(prompt.text) for prompt in batch], score_round

            ids, reward_fn = next_round()
            log = grpo_step(policy, engine, ids, reward_fn, settings, sampling, step_seed=step * SEED_STRIDE,
                            reference=reference, refill=next_round,
                            offload_optimizer=rl.rl_offload_optimizer_during_inference)
            log.update(step=step + 1, iteration=policy.iteration, reward_counts=_summed_counts(counts))
            logs.append(log)
            first_rank = not dist.is_initialized() or dist.get_rank() == 0
            if first_rank:
                _print(log)
            last = policy.iteration >= train_iters
            if run.checkpoint.save and (last or (interval and policy.iteration % interval < steps_per_rollout)):
                path = policy.save(run.checkpoint.save)
                if reference is not None:
                    reference.save(path)
                if first_rank:
                    (path / STATE_FILE).write_text(json.dumps({"prompts": prompts.state_dict()}))
    return logs


def _add_counts(total: dict, counts: dict) -> None:
    """A round's reward counts into the step's: numbers summed, the first error message kept."""
    for name, tally in counts.items():
        into = total.setdefault(name, dataclasses.asdict(RewardCounts()))
        for key, value in dataclasses.asdict(tally).items():
            into[key] = (into[key] or value) if key == "first_error" else into[key] + value


def _summed_counts(counts: dict) -> dict:
    """The reward tallies of every scoring rank, summed per reward (the first message kept)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return counts
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, counts)
    total: dict = {}
    for rank in every:
        for name, tally in rank.items():
            if name not in total:
                total[name] = dict(tally)
                continue
            for key, value in tally.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    total[name][key] += value
                elif total[name][key] is None:
                    total[name][key] = value
    return total


def _restore(location: str, policy: PolicyEngine, prompts: PromptIterator, reference) -> None:
    """The prompt position (and the KL reference) of the checkpoint the trainer has loaded (policy,
    optimizer, iteration, RNG)."""
    if read_tracker(Path(location)) is None:
        return  # nothing saved there yet: start afresh (as mega train)
    state_file = Path(location) / iteration_name(policy.iteration) / STATE_FILE
    if not state_file.exists():
        raise ConfigError(f"{state_file.parent} is not a mega rl checkpoint (no {STATE_FILE}): use it as --load "
                          "of a fresh run by --finetune, or resume from a mega rl --save")
    prompts.load_state_dict(json.loads(state_file.read_text())["prompts"])
    if reference is not None:
        try:
            reference.load(state_file.parent)
        except FileNotFoundError as error:
            raise ConfigError(f"{error}; start a run with a KL term by --finetune") from None


def _print(log: dict) -> None:
    def number(name, digits=3):
        value = log.get(name)
        return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"

    failures = sum(c["errors"] + c["timeouts"] + c["non_finite"] for c in log.get("reward_counts", {}).values())
    print(f"rl step {log['step']} | iteration {log['iteration']} | rollout {number('rollout_s', 2)} s "
          f"({number('rollout_tokens_per_s', 0)} tokens/s) | logprobs {number('logprobs_s', 2)} s | "
          f"update {number('update_s', 2)} s | refresh {number('refresh_s', 2)} s | reward {number('reward_mean')} "
          f"+- {number('reward_std')} | length {number('response_length', 1)} | loss {number('loss', 4)} | "
          f"clip {number('clip_fraction')} | entropy {number('entropy')} | kl {number('kl')} | "
          f"logprob gap mean {number('logprob_gap_mean', 6)} max {number('logprob_gap_max', 6)} | "
          f"reward failures {failures}" + _sampling_text(log), flush=True)


def _sampling_text(log: dict) -> str:
    """Dynamic sampling's part of the line, when it is on."""
    if "sampling_rounds" not in log:
        return ""
    return (f" | sampling rounds {log['sampling_rounds']} (groups filtered {log['groups_filtered']}, "
            f"without signal kept {log['groups_without_signal']})")


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        rl_parser().print_help()
        print("\nand every `mega train` flag (mega train --help), and --nproc-per-node N: start N local ranks")
        return 0
    early, _ = launcher_parser().parse_known_args(argv)
    if early.nproc_per_node:
        return launch_local(early.nproc_per_node, ["rl", *_without_launcher_flags(argv)])
    try:
        run_rl(argv)
    except (ConfigError, PluginError, PromptDataError, RewardSpecError, ValueError, FileNotFoundError) as error:
        print(f"mega rl: error: {error}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0

