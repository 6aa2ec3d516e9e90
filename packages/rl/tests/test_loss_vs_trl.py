"""mega.rl's GRPO loss, advantages, KL, importance weights and loss metrics against TRL's GRPOTrainer
on the same tensors (fp32, 1e-6). Runs on the CPU (pinned: TRL's trainer is built with use_cpu).

TRL keeps its loss and advantages inside ``GRPOTrainer``, so the test drives the trainer's own
methods, not a copy of them: a tiny randomly initialised LLaMA and a word-level tokenizer make a
real trainer; its ``_generate`` is replaced by fixed rollouts (prompt and completion ids, the
engine's log-probabilities) and its ``_get_per_token_logps_and_entropies`` by fixed
log-probabilities (old, then current) and entropies. Then

* ``_generate_and_score_completions`` (rewards from reward functions reading a dataset column,
  weighted, grouped by prompt) gives TRL's advantages and its truncated importance-sampling ratio
  ``min(exp(old - inference), cap)`` ("token_truncate"), compared with
  ``group_advantages`` and ``TokenLosses.is_weight``;
* ``_compute_loss`` on that batch gives TRL's loss for loss_type grpo, dapo and dr_grpo, compared
  with ``aggregate(grpo_token_losses(...).loss)`` in seq-mean-token-mean, token-mean and
  seq-mean-token-sum-norm; the per-token losses are read from TRL one token at a time (a mask
  holding one token: the aggregate is then that token's loss times a known factor);
* TRL's logged kl (k3), entropy and clip fractions (low, high, region) equal ``loss_metrics``.

TRL adds its entropy bonus as a token mean whatever the loss type; mega's entropy term is a
per-token part of the loss (Megatron's), so the two agree under token-mean, where it is compared.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from mega.rl.advantages import group_advantages  # noqa: E402
from mega.rl.loss import aggregate, grpo_token_losses, loss_metrics  # noqa: E402

DEVICE = torch.device("cpu")
GROUP = 4
PROMPTS = 2
MAX_NEW_TOKENS = 6
CAP = 1.5            # TRL's vllm_importance_sampling_cap, Megatron's --rl-importance-sampling-truncation-coef
WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(29)]
# loss_type of TRL -> mega's aggregation
REFERENCE = object()  # stands for TRL's reference model: its log-probabilities are the fixed ones
AGGREGATION = {"grpo": "seq-mean-token-mean", "dapo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}


def _tiny_trainer(tmp_path, loss_type, beta, eps_low, eps_high, entropy_coef, weights, scale_rewards="group"):
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    config = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, fp16=False,
        per_device_train_batch_size=GROUP * PROMPTS, per_device_eval_batch_size=GROUP * PROMPTS,
        num_generations=GROUP, num_generations_eval=GROUP, max_completion_length=MAX_NEW_TOKENS,
        loss_type=loss_type, beta=0.0, epsilon=eps_low, epsilon_high=eps_high, entropy_coef=entropy_coef,
        scale_rewards=scale_rewards, reward_weights=weights,
        # Megatron's (and GRPO's) k3 term as it is; TRL's default multiplies it by the ratio (DeepSeek-V3.2)
        use_bias_correction_kl=False)

    def correctness(completions, correct, **_):
        return list(correct)

    def style(completions, styled, **_):
        return list(styled)

    dataset = Dataset.from_list([{"prompt": "w1 w2", "correct": 0.0, "styled": 0.0}] * GROUP)
    trainer = GRPOTrainer(model=model, reward_funcs=[correctness, style], args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.model.eval()  # TRL's eval mode: no division by gradient-accumulation steps
    # Built without a KL so that TRL does not load a reference model by name; the reference's
    # log-probabilities come from the fixed ones below (for the REFERENCE stand-in).
    trainer.beta = beta
    trainer.ref_model = REFERENCE
    return trainer


@pytest.fixture(scope="module")
def rollouts():
    """Fixed rollouts: completions of 2..6 tokens, the log-probabilities of four policies, rewards."""
    generator = torch.Generator().manual_seed(7)
    batch = GROUP * PROMPTS
    lengths = torch.tensor([6, 3, 5, 2, 4, 6, 1, 5])
    mask = (torch.arange(MAX_NEW_TOKENS)[None, :] < lengths[:, None]).to(torch.float32)

    def logps(scale=1.0):
        return -(torch.rand(batch, MAX_NEW_TOKENS, generator=generator) * 2.0 + 0.05) * scale

    old = logps()
    # current and inference near old (ratios within and beyond the clip range), the reference further off
    current = old + (torch.rand(batch, MAX_NEW_TOKENS, generator=generator) - 0.5) * 0.8
    inference = old + (torch.rand(batch, MAX_NEW_TOKENS, generator=generator) - 0.5) * 1.0
    reference = old + (torch.rand(batch, MAX_NEW_TOKENS, generator=generator) - 0.5) * 1.5
    entropy = torch.rand(batch, MAX_NEW_TOKENS, generator=generator) * 3.0
    correct = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    styled = [0.5, 0.25, 0.0, 1.0, 0.75, 0.5, 0.5, 0.0]
    return dict(lengths=lengths, mask=mask, old=old * mask, current=current * mask, inference=inference * mask,
                reference=reference * mask, entropy=entropy * mask, correct=correct, styled=styled)


def _drive_trl(trainer, rollouts, *, probe_mask=None):
    """TRL's advantages and importance ratio for the rollouts, then its loss (over ``probe_mask``
    in place of the completion mask when given)."""
    lengths = rollouts["lengths"].tolist()
    completion_ids = [[3 + (i + t) % 20 for t in range(n)] for i, n in enumerate(lengths)]
    prompt_ids = [[4, 5]] * len(lengths)
    sampling = [rollouts["inference"][i, :n].tolist() for i, n in enumerate(lengths)]
    trainer._generate = lambda prompts: (prompt_ids, completion_ids, None, ["x"] * len(prompts), sampling, {},
                                         None, [])
    current = {"logps": rollouts["old"]}

    def fixed_logps(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **_):
        if model is REFERENCE:
            return rollouts["reference"], None, None
        return current["logps"], (rollouts["entropy"] if compute_entropy else None), None

    trainer._get_per_token_logps_and_entropies = fixed_logps
    # The importance-sampling correction of TRL's vLLM path, with the engine's log-probabilities above.
    trainer.use_vllm = True
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = "token_truncate"
    trainer.vllm_importance_sampling_clip_min = None
    trainer.vllm_importance_sampling_clip_max = CAP
    inputs = [{"prompt": "w1 w2", "correct": c, "styled": s} for c, s in zip(rollouts["correct"], rollouts["styled"], strict=True)]
    trainer._metrics["eval"].clear()
    batch = trainer._generate_and_score_completions(inputs)
    assert torch.equal(batch["completion_mask"].to(torch.float32), rollouts["mask"])  # TRL padded as we did
    assert torch.equal(batch["old_per_token_logps"], rollouts["old"])
    current["logps"] = rollouts["current"]
    if probe_mask is not None:
        batch["completion_mask"] = probe_mask.to(torch.long)
        batch["num_items_in_batch"] = probe_mask.sum()
    loss = trainer._compute_loss(trainer.model, batch)
    return batch, float(loss), {k: v[-1] for k, v in trainer._metrics["eval"].items()}


CASES = [  # loss_type, beta, eps_low, eps_high, entropy_coef, advantages divided by the group's std
    ("grpo", 0.04, 0.2, 0.2, 0.0, True),
    ("dapo", 0.0, 0.2, 0.28, 0.0, True),      # DAPO: clip-higher, no KL
    ("dapo", 0.1, 0.1, 0.3, 0.01, True),      # with the KL and the entropy bonus (both token means here)
    ("dr_grpo", 0.02, 0.2, 0.2, 0.0, False),  # Dr. GRPO: centred rewards, not divided by the std
]


@pytest.mark.parametrize("loss_type,beta,eps_low,eps_high,entropy_coef,scale", CASES)
def test_grpo_loss_equals_trl(tmp_path, rollouts, loss_type, beta, eps_low, eps_high, entropy_coef, scale):
    weights = [1.0, 0.5]
    trainer = _tiny_trainer(tmp_path, loss_type, beta, eps_low, eps_high, entropy_coef, weights,
                            scale_rewards="group" if scale else "none")
    batch, trl_loss, trl_metrics = _drive_trl(trainer, rollouts)
    mask = rollouts["mask"]

    # Advantages: the weighted reward sum, centred and scaled per group of GROUP completions.
    rewards = torch.tensor(rollouts["correct"]) * weights[0] + torch.tensor(rollouts["styled"]) * weights[1]
    advantages = group_advantages(rewards, GROUP, scale_by_std=scale)
    torch.testing.assert_close(advantages, batch["advantages"], rtol=0, atol=1e-6)

    terms = grpo_token_losses(
        rollouts["current"], rollouts["old"], advantages, reference=rollouts["reference"],
        inference=rollouts["inference"], entropy=rollouts["entropy"], clamp_eps_lower=eps_low,
        clamp_eps_upper=eps_high, kl_beta=beta, entropy_weight=entropy_coef, is_truncation_coef=CAP)
    # The importance weight: TRL's ratio over the completion tokens (it leaves 1 on padding).
    torch.testing.assert_close(terms.is_weight * mask, batch["importance_sampling_ratio"] * mask, rtol=0, atol=1e-6)
    assert (terms.is_weight == CAP).any() and (terms.is_weight < CAP).any()  # the truncation acts here

    ours = aggregate(terms.loss, mask, AGGREGATION[loss_type], max_tokens=MAX_NEW_TOKENS)
    assert abs(float(ours) - trl_loss) <= 1e-6, (float(ours), trl_loss)

    metrics = loss_metrics(terms, mask, old=rollouts["old"], inference=rollouts["inference"])
    pairs = {"clip_fraction_low": "clip_ratio/low_mean", "clip_fraction_high": "clip_ratio/high_mean",
             "clip_fraction": "clip_ratio/region_mean", "entropy": "entropy",
             "logprob_gap_mean": "sampling/sampling_logp_difference/mean",
             "logprob_gap_max": "sampling/sampling_logp_difference/max"}
    if beta:
        pairs["kl"] = "kl"
    for ours_name, trl_name in pairs.items():
        assert abs(metrics[ours_name] - trl_metrics[trl_name]) <= 1e-6, (ours_name, metrics[ours_name], trl_metrics)
    assert 0 < metrics["clip_fraction"] < 1  # the clip binds on some tokens, not all


@pytest.mark.parametrize("loss_type,beta,eps_low,eps_high", [("grpo", 0.04, 0.2, 0.2), ("dapo", 0.0, 0.2, 0.28),
                                                             ("dr_grpo", 0.02, 0.2, 0.2)])
def test_per_token_losses_and_kl_equal_trl(tmp_path, rollouts, loss_type, beta, eps_low, eps_high):
    """Each token's loss, read from TRL's _compute_loss over a mask holding that token alone."""
    trainer = _tiny_trainer(tmp_path, loss_type, beta, eps_low, eps_high, 0.0, [1.0, 0.5])
    mask = rollouts["mask"]
    batch, _, _ = _drive_trl(trainer, rollouts)
    terms = grpo_token_losses(
        rollouts["current"], rollouts["old"], batch["advantages"], reference=rollouts["reference"],
        inference=rollouts["inference"], clamp_eps_lower=eps_low, clamp_eps_upper=eps_high, kl_beta=beta,
        is_truncation_coef=CAP)
    batch_size = mask.shape[0]
    # What one token's loss is multiplied by in each aggregate when it is the only token in the mask.
    factor = {"grpo": 1.0 / batch_size, "dapo": 1.0, "dr_grpo": 1.0 / (batch_size * MAX_NEW_TOKENS)}[loss_type]
    trl_tokens = torch.zeros_like(mask)
    for b, t in mask.nonzero().tolist():
        probe = torch.zeros_like(mask)
        probe[b, t] = 1
        _, loss, metrics = _drive_trl(trainer, rollouts, probe_mask=probe)
        trl_tokens[b, t] = loss / factor
        if beta:
            assert abs(metrics["kl"] - float(terms.kl[b, t])) <= 1e-6
    torch.testing.assert_close(terms.loss * mask, trl_tokens, rtol=0, atol=1e-6)
