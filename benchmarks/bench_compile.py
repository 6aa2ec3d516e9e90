"""``--compile`` (torch.compile per transformer layer, inductor) against eager: one training
step of mega's GPT and LLaMA (forward, fp32 cross-entropy, backward) on one device.

The first compiled steps pay for compilation (reported apart); the table compares the median of
the timed steps after it. Both runs start from the same weights; the losses of the first step
are printed to show they agree.

    python benchmarks/bench_compile.py                       # both families, CPU defaults
    python benchmarks/bench_compile.py --family llama --steps 20 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mega.core.build import build_stage
from mega.models.gpt.family import FAMILY as GPT_FAMILY
from mega.models.llama.family import FAMILY as LLAMA_FAMILY
from mega.train.compile import compile_stage

FAMILIES = {"gpt": GPT_FAMILY, "llama": LLAMA_FAMILY}


def config_of(family, args):
    groups = args.heads // 2 if family is LLAMA_FAMILY else args.heads
    return family.preset("tiny", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                         num_query_groups=groups, ffn_hidden_size=None, kv_channels=None, seq_length=args.seq,
                         max_position_embeddings=args.seq, vocab_size=args.vocab, hidden_dropout=0.0,
                         attention_dropout=0.0)


class Stepper:
    """One model and one batch; ``step()`` runs forward, loss and backward, timed."""

    def __init__(self, family, config, args, compiled: bool):
        self.model = build_stage(family, config, seed=1)
        if compiled:
            compile_stage(family, self.model, args.backend)
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        self.labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)

    def step(self) -> tuple[float, float]:
        start = time.perf_counter()
        logits = self.model(self.tokens)  # [s, b, vocab]
        loss = self.model.loss(logits, self.labels).mean()
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        return time.perf_counter() - start, loss.item()


def measure(family, config, args) -> dict:
    """Warm both up (compiling), then alternate eager and compiled steps so that load on the
    machine affects both alike."""
    eager, compiled = Stepper(family, config, args, False), Stepper(family, config, args, True)
    compile_s, first_losses = 0.0, None
    for _ in range(max(1, args.warmup)):
        eager_loss = eager.step()[1]
        seconds, compiled_loss = compiled.step()
        compile_s += seconds
        first_losses = first_losses or (eager_loss, compiled_loss)
    first_eager, first_compiled = first_losses
    times = {"eager": [], "compiled": []}
    for _ in range(args.steps):
        times["eager"].append(eager.step()[0])
        times["compiled"].append(compiled.step()[0])
    eager_ms, compiled_ms = (statistics.median(times[k]) * 1e3 for k in ("eager", "compiled"))
    return {"eager_ms": round(eager_ms, 1), "compiled_ms": round(compiled_ms, 1),
            "speedup": round(eager_ms / compiled_ms, 2), "compile_s": round(compile_s, 1),
            "first_loss_eager": round(first_eager, 5), "first_loss_compiled": round(first_compiled, 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=[*FAMILIES, "all"], default="all")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in FAMILIES if args.family == "all" else [args.family]:
        family = FAMILIES[name]
        config = config_of(family, args)
        rows.append({"family": name, **measure(family, config, args)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| family | eager ms/step | compiled ms/step | speed-up | first steps (compiling) s | first loss eager / compiled |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['eager_ms']} | {r['compiled_ms']} | {r['speedup']}x | {r['compile_s']} | "
              f"{r['first_loss_eager']} / {r['first_loss_compiled']} |")


if __name__ == "__main__":
    main()
