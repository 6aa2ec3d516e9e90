"""One GRPO step: mega (``mega.rl.grpo_step``: its engine's rollouts, the trainer's log-probabilities
and update, the refresh) against TRL's ``GRPOTrainer`` (transformers ``generate``), on the CPU.

Both hold the same tiny LLaMA (random weights made by ``transformers`` and mapped into mega by the
family's ``hf_mapping``), the same prompts (``--prompts`` of ``--prompt-len`` random tokens), group
size, completion length (``--new-tokens``, sampled at temperature 1, ended early by the last id,
TRL's ``<eos>``; both print their mean response length), one pass (``num_iterations`` / ``--grpo-iterations`` 1), the whole batch
in one optimizer step, AdamW at the same learning rate without weight decay, no KL term, and the
same reward (the fraction of completion tokens below 16). mega's rollouts decode through the
engine's forward compiled once (``--rollout-compile``, inductor by default; the warm-up step pays
the compilation; ``none``: eager, on the paged cache). Each times ``--steps`` steps after one
warm-up step and prints the median seconds per step, mega's phases, and the ratio mega / TRL; and
the same for the process's CPU seconds per step (``time.process_time``), which on a machine
shared with other jobs moves far less than the wall time (that counts the waits for a core too).

    OMP_NUM_THREADS=1 python benchmarks/bench_rl.py --steps 7
    python benchmarks/bench_rl.py --layers 4 --hidden 128 --new-tokens 32 --steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rollout-compile", default="inductor",
                        help="torch.compile backend of mega's rollout decode step (static KV cache); 'none': the "
                             "paged cache, eager")
    return parser.parse_args()


def hf_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.prompt_len + args.new_tokens,
                         tie_word_embeddings=False, attention_dropout=0.0)
    return LlamaForCausalLM(config)


def prompt_ids(args) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(16, args.vocab - 2, (args.prompt_len,), generator=generator).tolist()
            for _ in range(args.prompts)]


def low_fraction(tokens) -> float:
    return sum(t < 16 for t in tokens) / max(len(tokens), 1)


def time_mega(args, hf) -> tuple[list[float], list[float], list[dict]]:
    from mega.core.plugins import get_plugins
    from mega.models.hf_mapping import hf_to_mega
    from mega.rl.grpo_step import GRPOSettings, grpo_step
    from mega.rl.policy_engine import PolicyEngine
    from mega.rl.rollouts import RolloutEngine, RolloutSampling

    sequences = args.prompts * args.group
    # The RoPE base as mega reads it from the Hugging Face config (the mapping's own reading).
    mapped = get_plugins().models.get("llama").hf_mapping.config_from_hf(hf.config.to_dict())
    policy = PolicyEngine.from_args([
        "--model-family", "llama", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--ffn-hidden-size", str(2 * args.hidden), "--num-attention-heads", str(args.heads),
        "--num-query-groups", str(args.heads), "--seq-length", str(args.prompt_len + args.new_tokens),
        "--max-position-embeddings", str(args.prompt_len + args.new_tokens), "--vocab-size", str(args.vocab),
        "--make-vocab-size-divisible-by", "1", "--untie-embeddings-and-output-weights",
        "--micro-batch-size", str(sequences), "--global-batch-size", str(sequences), "--lr", str(args.lr),
        "--lr-decay-style", "constant", "--weight-decay", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--train-iters", "1000", "--eval-iters", "0", "--rotary-base", str(mapped.rotary_base),
        "--norm-epsilon", str(mapped.layernorm_epsilon)])
    config = policy.trainer.run.model
    weights = hf_to_mega(policy.trainer.family.hf_mapping, hf.state_dict(), config)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            param.copy_(weights[name])
    engine = RolloutEngine(policy.model, vocab_size=args.vocab, max_positions=args.prompt_len + args.new_tokens,
                           compile_backend=None if args.rollout_compile == "none" else args.rollout_compile)
    settings = GRPOSettings(group_size=args.group, global_batch_size=sequences, scale_by_std=True)
    # TRL's tokenizer below ends a completion at <eos>, the last id: so does mega's engine here.
    sampling = RolloutSampling(max_new_tokens=args.new_tokens, stop_ids=frozenset({args.vocab - 1}), seed=0)
    prompts = prompt_ids(args)

    def reward(rollouts):
        return torch.tensor([low_fraction(c) for c in rollouts.completions])

    times, cpu, logs = [], [], []
    for step in range(args.steps + 1):
        start, start_cpu = time.perf_counter(), time.process_time()
        log = grpo_step(policy, engine, prompts, reward, settings, sampling, step_seed=step * 2**20)
        if step:  # the first is the warm-up
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            logs.append(log)
    return times, cpu, logs


def time_trl(args, hf) -> tuple[list[float], list[float], float]:
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    words = [f"w{i}" for i in range(args.vocab - 2)] + ["<pad>", "<eos>"]
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", eos_token="<eos>")
    texts = [" ".join(words[t] for t in p) for p in prompt_ids(args)]
    dataset = Dataset.from_list([{"prompt": text} for text in texts])
    lengths = []

    def reward(completions, **_):
        ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
        lengths.extend(len(i) for i in ids)
        return [low_fraction(i) for i in ids]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.cpu, self._start = [], [], None

        def on_step_begin(self, *_, **__):
            self._start = time.perf_counter(), time.process_time()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self._start[0])
            self.cpu.append(time.process_time() - self._start[1])

    timer = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, use_cpu=True, report_to="none", bf16=False, fp16=False, save_strategy="no",
            per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
            max_completion_length=args.new_tokens, learning_rate=args.lr, lr_scheduler_type="constant",
            weight_decay=0.0, beta=0.0, num_iterations=1, temperature=1.0, max_steps=args.steps + 1,
            logging_steps=1000, seed=0, loss_type="dapo")
        trainer = GRPOTrainer(model=hf, reward_funcs=[reward], args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[timer])
        trainer.train()
    return timer.times[1:], timer.cpu[1:], statistics.mean(lengths) if lengths else 0.0


def main() -> None:
    args = options()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    hf = hf_model(args)
    mega_times, mega_cpu, logs = time_mega(args, hf)
    trl_times, trl_cpu, trl_length = time_trl(args, hf_model(args))  # a fresh copy of the same weights
    mega_step, trl_step = statistics.median(mega_times), statistics.median(trl_times)
    phases = {name: statistics.median(log[name] for log in logs)
              for name in ("rollout_s", "logprobs_s", "update_s", "refresh_s")}
    print(f"shape: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; {args.prompts} prompts x "
          f"group {args.group}, {args.prompt_len} prompt + {args.new_tokens} new tokens; {args.steps} steps timed")
    print(f"mega  GRPO step {mega_step:.3f} s (median) | " + " | ".join(f"{k[:-2]} {v:.3f} s" for k, v in phases.items())
          + f" | rollout {statistics.median(log['rollout_tokens_per_s'] for log in logs):.0f} tokens/s"
          + f" | response length {statistics.mean(log['response_length'] for log in logs):.1f}")
    print(f"TRL   GRPO step {trl_step:.3f} s (median) | response length {trl_length:.1f}")
    print(f"ratio mega / TRL: {mega_step / trl_step:.2f}")
    mega_cpu_step, trl_cpu_step = statistics.median(mega_cpu), statistics.median(trl_cpu)
    print(f"CPU seconds per step (median): mega {mega_cpu_step:.3f} | TRL {trl_cpu_step:.3f} | "
          f"ratio mega / TRL: {mega_cpu_step / trl_cpu_step:.2f}")


if __name__ == "__main__":
    main()
