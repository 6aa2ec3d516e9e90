"""The RL section of a run's configuration: Megatron-RL's flags, and the options the literature
uses that Megatron lacks, each with its paper's name in its help. Declared once here (see
mega.core.config.options): the parser, TOML loading and the flag reference come from it.

What reads each field: the loss (mega.rl.loss), the advantages and filters (mega.rl.advantages),
the rewards (mega.rl.rewards), the prompt data (mega.rl.prompts), and `mega rl`'s loop
(mega.rl.command, mega.rl.grpo_step) the rest. docs/rl.md says which are not used yet.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any, Literal

from mega.core.config.options import flag_of, option
from mega.rl.loss import AGGREGATIONS


@dataclass
class RLConfig:
    grpo_group_size: int = option(8, "completions sampled per prompt: the group whose rewards are compared")
    grpo_prompts_per_step: int = option(32, "prompts per rollout batch")
    grpo_iterations: int = option(
        1, "optimisation passes over each batch of rollouts (the old policy's log-probabilities are recomputed by "
        "the trainer once per batch); each pass takes optimizer steps of --global-batch-size sequences")
    grpo_clamp_eps_lower: float = option(0.2, "PPO ratio clip from below: the ratio is clamped to 1 - this")
    grpo_clamp_eps_upper: float = option(
        0.2, "PPO ratio clip from above: 1 + this; above --grpo-clamp-eps-lower it is DAPO's clip-higher "
        "(Decoupled Clip, the DAPO paper uses 0.28 with 0.2 below)")
    grpo_kl_beta: float = option(
        0.0, "weight of the KL penalty against the reference policy, by Schulman's k3 estimator "
        "(GRPO, DeepSeekMath); 0: no reference is kept")
    grpo_entropy_term_weight: float = option(0.0, "weight of the entropy bonus per token")
    rl_inference_logprobs_is_correction: bool = option(
        False, "weight each token by exp(old - inference) log-probabilities: the trainer's policy against the "
        "engine's numerics (truncated importance sampling, Yao et al. 2025, 'Your efficient RL framework secretly "
        "brings you off-policy RL training')")
    rl_importance_sampling_truncation_coef: float | None = option(
        None, "with --rl-inference-logprobs-is-correction: the importance weight is truncated to at most this")
    grpo_loss_aggregation: Literal[AGGREGATIONS] = option(  # type: ignore[valid-type]
        "token-mean", "how per-token losses make the loss: token-mean (DAPO's token-level policy gradient loss), "
        "seq-mean-token-mean (GRPO as published, DeepSeekMath), seq-mean-token-sum, or seq-mean-token-sum-norm "
        "(Dr. GRPO, 'Understanding R1-Zero-Like Training': token sums over --rl-max-new-tokens)")
    grpo_std_normalization: bool = option(
        True, "divide each group's centred rewards by their standard deviation (GRPO); "
        "--no-grpo-std-normalization leaves them centred only (Dr. GRPO)", action=argparse.BooleanOptionalAction)
    rl_dynamic_sampling: bool = option(
        False, "drop the groups whose rewards are all equal, which carry no advantage, and roll out more prompts "
        "until the step has --grpo-prompts-per-step groups that do (DAPO's dynamic sampling)")
    rl_dynamic_sampling_max_rounds: int = option(
        10, "with --rl-dynamic-sampling: rounds of --grpo-prompts-per-step prompts a step rolls out at most (verl's "
        "max_num_gen_batches); after the last, groups without signal make up the batch, counted in the log")
    rl_overlong_filtering: bool = option(
        False, "leave completions cut at --rl-max-new-tokens out of the loss (DAPO's overlong filtering)")
    rl_overlong_buffer_length: int = option(
        0, "the last N tokens before --rl-max-new-tokens lower the reward linearly to minus "
        "--rl-overlong-penalty-factor (DAPO's soft overlong punishment); 0: off")
    rl_overlong_penalty_factor: float = option(1.0, "the largest soft overlong punishment (DAPO)")
    rl_max_new_tokens: int | None = option(
        None, "the longest completion a rollout may generate; needed by seq-mean-token-sum-norm and the "
        "overlong options")
    moe_enable_routing_replay: bool = option(
        False, "MoE policies: the experts each token was routed to by the old policy (recorded when the trainer "
        "recomputes its log-probabilities) are forced in every update over the rollouts, the router weighting "
        "them and still learning (Routing Replay of the GSPO paper, Zheng et al. 2025: R2, the old policy's routing; "
        "not yet R3, the rollout engine's, Ma et al. 2025; Megatron-LM's flag)")
    rl_temperature: float = option(1.0, "rollout sampling temperature")
    rl_top_p: float = option(0.0, "rollout nucleus sampling: the smallest set of tokens with this much probability "
                             "(0 or 1: off)")
    rl_top_k: int = option(0, "rollout sampling from the k most likely tokens (0: off)")
    rl_stop: list[str] = option(
        default_factory=list, help="rollout stop strings (the tokenizer's end of document always stops); "
        "repeated flags add up", action="extend")
    rl_seed: int | None = option(
        None, "rollout sampling seed (default: --seed); completion i of step s samples with seed + s * 2**20 + i, "
        "so a resumed run draws the same completions")
    rl_inference_tensor_model_parallel_size: int | None = option(
        None, "the rollout engine's tensor-parallel size (default: --tensor-model-parallel-size); the engine holds "
        "every layer, so the world is this many ranks times engine replicas, which split each step's prompts. At "
        "the training's size, with one pipeline stage and no FSDP, sequence, context or expert parallelism, the "
        "engine generates from the trainer's own parameters; otherwise it has its own copy, refreshed after every "
        "update without disk (Megatron-RL's flag)")
    rl_inference_compile_backend: str | None = option(
        None, "torch.compile backend of the rollout engine's decode step (inductor; aot_eager traces without "
        "generating code): rollouts then decode on the static KV cache, a slot per sequence, through the engine's "
        "forward compiled once in the first rollout (the trainer's parameters, updated in place, stay its inputs). "
        "Default: eager, on the paged cache. At engine tensor-parallel size 1")
    rl_offload_optimizer_during_inference: bool = option(
        False, "keep the optimizer state (fp32 main weights, moments) and the gradient buffers in host memory while "
        "the engine generates (Megatron-RL's flag; verl's actor optimizer_offload)")
    prompt_data: str | None = option(
        None, "prompts, JSON Lines: `prompt` (text) or `messages` (a chat, rendered by the chat template) and any "
        "other fields, which reach the rewards")
    chat_template: str | None = option(
        None, "the Jinja chat template (or tokenizer_config.json) for `messages` prompts (default: the tokenizer's)")
    reward: list[str] = option(
        default_factory=list, help="reward functions, each NAME[:WEIGHT] (registered by a plugin, see `mega "
        "plugins`) or module:function[:WEIGHT]; a completion's reward is the weighted sum; repeated flags add up "
        "(--reward a --reward b is --reward a b)", action="extend")
    reward_workers: int = option(4, "processes that compute rewards")
    reward_timeout: float = option(
        10.0, "seconds one reward call may take; a call that raises, runs longer or returns a non-finite value "
        "scores 0 and is counted in the log")

    def __post_init__(self) -> None:
        for name in ("grpo_group_size", "grpo_prompts_per_step", "grpo_iterations", "reward_workers",
                     "rl_dynamic_sampling_max_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be positive, got {getattr(self, name)}")
        if self.grpo_group_size < 2 and (self.grpo_std_normalization or self.rl_dynamic_sampling):
            raise ValueError("--grpo-group-size 1 has no group to compare a reward with; use 2 or more")
        if not (0 <= self.grpo_clamp_eps_lower < 1 and self.grpo_clamp_eps_upper >= 0):
            raise ValueError(f"--grpo-clamp-eps-lower must be in [0, 1) and --grpo-clamp-eps-upper >= 0, got "
                             f"{self.grpo_clamp_eps_lower} and {self.grpo_clamp_eps_upper}")
        for name in ("grpo_kl_beta", "grpo_entropy_term_weight", "rl_overlong_buffer_length",
                     "rl_overlong_penalty_factor"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.rl_importance_sampling_truncation_coef is not None:
            if not self.rl_inference_logprobs_is_correction:
                raise ValueError("--rl-importance-sampling-truncation-coef truncates the correction of "
                                 "--rl-inference-logprobs-is-correction, which is off")
            if self.rl_importance_sampling_truncation_coef <= 0:
                raise ValueError("--rl-importance-sampling-truncation-coef must be positive")
        needs_length = [flag for flag, on in (
            ("--grpo-loss-aggregation seq-mean-token-sum-norm", self.grpo_loss_aggregation == "seq-mean-token-sum-norm"),
            ("--rl-overlong-filtering", self.rl_overlong_filtering),
            ("--rl-overlong-buffer-length", self.rl_overlong_buffer_length > 0)) if on]
        if needs_length and not self.rl_max_new_tokens:
            raise ValueError(f"{', '.join(needs_length)} needs --rl-max-new-tokens")
        if self.rl_max_new_tokens is not None and self.rl_overlong_buffer_length > self.rl_max_new_tokens:
            raise ValueError(f"--rl-overlong-buffer-length {self.rl_overlong_buffer_length} exceeds "
                             f"--rl-max-new-tokens {self.rl_max_new_tokens}")
        if not self.rl_temperature > 0 or self.rl_top_k < 0 or not 0 <= self.rl_top_p <= 1:
            raise ValueError(f"--rl-temperature must be positive, --rl-top-k >= 0 and --rl-top-p in [0, 1], got "
                             f"{self.rl_temperature}, {self.rl_top_k} and {self.rl_top_p}")
        size = self.rl_inference_tensor_model_parallel_size
        if size is not None and size < 1:
            raise ValueError(f"--rl-inference-tensor-model-parallel-size must be positive, got {size}")
        if self.reward_timeout <= 0:
            raise ValueError(f"--reward-timeout must be positive, got {self.reward_timeout}")

    def token_loss_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`mega.rl.loss.grpo_token_losses` these flags set."""
        return {"clamp_eps_lower": self.grpo_clamp_eps_lower, "clamp_eps_upper": self.grpo_clamp_eps_upper,
                "kl_beta": self.grpo_kl_beta, "entropy_weight": self.grpo_entropy_term_weight,
                "is_truncation_coef": self.rl_importance_sampling_truncation_coef}

    def aggregation_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`mega.rl.loss.aggregate` these flags set."""
        return {"mode": self.grpo_loss_aggregation, "max_tokens": self.rl_max_new_tokens}

def _flag(name: str) -> str:
    return flag_of(next(f for f in fields(RLConfig) if f.name == name))
