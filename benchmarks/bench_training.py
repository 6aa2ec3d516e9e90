"""Training throughput on one process: `mega train`'s loop against a plain Hugging Face loop.

mega: the real training path (model from the family, DDP wrapper, mixed-precision AdamW with
global-norm clipping, LR schedule, schedule hooks) on Megatron's mock data.
Hugging Face: ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` of the same configuration (mega's model
config is mapped from it, so the architectures are identical), ``torch.optim.AdamW`` with the
same decay groups, ``clip_grad_norm_``, batches of random tokens of the same shape.
Rounds alternate between the two so load on a shared machine hits both alike; the figure is the
median step time over all timed steps.

    python benchmarks/bench_training.py                 # gpt and llama, fp32
    python benchmarks/bench_training.py --family llama --rounds 5 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from bench_models import add_shape_arguments, hf_configs  # noqa: E402  (the same shapes as bench_models)

from mega.core.plugins import hookimpl, load_plugins  # noqa: E402
from mega.models.gpt.hf_gpt2 import gpt2_config  # noqa: E402
from mega.models.llama.hf_llama import llama_config  # noqa: E402
from mega.train.command import parse_run  # noqa: E402
from mega.train.launch_run import run_training  # noqa: E402


class StepTimes:
    def __init__(self):
        self.seconds: list[float] = []

    @hookimpl
    def on_step_end(self, metrics):
        self.seconds.append(metrics["elapsed_s"])


def mega_step_times(args, family: str, steps: int) -> list[float]:
    times = StepTimes()

    class Recorder:
        @hookimpl
        def register_callbacks(self, register):
            register("bench-step-times", lambda run_config: times)

    argv = [
        "--model-family", family, "--mock-data", "--micro-batch-size", str(args.batch), "--train-iters", str(steps),
        "--eval-iters", "0", "--log-interval", "100000", "--lr", "1e-4", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--split", "100,0,0",
    ]
    plugins = load_plugins(extra=[("bench", Recorder())])
    run, model_family = parse_run(argv, plugins)
    # The very architecture of the Hugging Face model (activation, norms, GQA...), mapped over.
    to_mega = gpt2_config if family == "gpt" else llama_config
    model = dataclasses.replace(to_mega(hf_configs(args)[family].to_dict()), hidden_dropout=0.0, attention_dropout=0.0)
    run_training(dataclasses.replace(run, model=model), model_family, plugins)
    return times.seconds[1:]  # the first step pays for allocation


def hf_step_times(args, family: str, steps: int) -> list[float]:
    hf_config = hf_configs(args)[family]
    model_class = transformers.GPT2LMHeadModel if family == "gpt" else transformers.LlamaForCausalLM
    model = model_class(hf_config).train()
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1 or n.endswith(".bias")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for _ in range(steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    return seconds[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=["gpt", "llama", "both"], default="both")
    add_shape_arguments(parser)
    parser.add_argument("--steps", type=int, default=6, help="steps per round (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    families = ["gpt", "llama"] if args.family == "both" else [args.family]
    rows = []
    for family in families:
        mega, hf = [], []
        for _ in range(args.rounds):
            mega += mega_step_times(args, family, args.steps)
            hf += hf_step_times(args, family, args.steps)
        tokens = args.batch * args.seq
        mega_s, hf_s = statistics.median(mega), statistics.median(hf)
        rows.append({"family": family, "dtype": "fp32", "hf_s_per_step": hf_s, "mega_s_per_step": mega_s,
                     "hf_tokens_per_s": tokens / hf_s, "mega_tokens_per_s": tokens / mega_s,
                     "mega_over_hf_speed": hf_s / mega_s, "threads": torch.get_num_threads()})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| family | dtype | HF s/step | mega s/step | HF tok/s | mega tok/s | mega / HF speed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['dtype']} | {r['hf_s_per_step']:.3f} | {r['mega_s_per_step']:.3f} | "
              f"{r['hf_tokens_per_s']:.0f} | {r['mega_tokens_per_s']:.0f} | {r['mega_over_hf_speed']:.2f}x |")


if __name__ == "__main__":
    main()
