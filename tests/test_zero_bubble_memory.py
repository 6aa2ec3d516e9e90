"""ZB-H1's peak memory per rank against 1F1B's on real transformer layers (CPU, gloo, fp32).

LLaMA (8 layers, hidden 64, sequence 64, vocabulary 8 x hidden as real models have it) at pp4
with 8 micro-batches, run by ``forward_backward`` under ``1f1b`` and ``zb-h1`` from the same
weights. Each rank's peak is the most memory its step allocated at once (the allocator's own
record through torch's profiler: activations, what a W holds, messages, temporaries).

ZB-H1 keeps every rank at ``pp`` micro-batches from forward to W (the paper's accounting), 1F1B
rank ``r`` at ``pp - r``; a W holds its layers' inputs and output gradients (in a LLaMA layer
about 4/5 of what its forward saved). So:

* the first rank holds exactly 1F1B's bytes (its B computes the weight gradients, as W would
  run right after it: mega.core.pipeline.schedules);
* the middle ranks hold no more than 1F1B's largest rank (the first);
* the last rank holds back ``pp - 1`` W, but not the output layer's ``[tokens, vocabulary]``
  output gradient: the loss's W rebuilds it (mega.core.parallel.output_layer_loss), so it too
  stays under 1F1B's largest rank (4.15 MiB against 4.45). Holding those gradients, as W did
  before, put it at 5.14: above by about their size.

Before W handed each weight's gradient over as soon as its product ran, every rank that runs W
held all its weight gradients at once on top, and the first rank failed the first check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mega.core.build import build_stage
from mega.core.model_family import LossContext
from mega.core.parallel import ParallelConfig, ParallelGroups
from mega.core.pipeline import forward_backward, setup_tied_weights
from mega.models.gpt.family import FAMILY as GPT
from mega.models.llama.family import FAMILY as LLAMA
from mega.testing.peak_memory import peak_allocated_bytes

PP, MICROBATCHES, MICRO_BATCH, SEQ, HIDDEN, VOCAB = 4, 8, 2, 64, 64, 512
FAMILIES = {"gpt": GPT, "llama": LLAMA}


def peaks_per_schedule(family_name: str, layers_per_stage: tuple[int, ...] = (2, 2, 2, 2)) -> dict:
    """On every rank of a pp4 world: this rank's peak bytes of one step under each schedule, and
    the losses of that step."""
    family = FAMILIES[family_name]
    config = family.preset("tiny", num_layers=sum(layers_per_stage), hidden_size=HIDDEN, num_attention_heads=4,
                           seq_length=SEQ, max_position_embeddings=SEQ, vocab_size=VOCAB, hidden_dropout=0.0,
                           attention_dropout=0.0)
    groups = ParallelGroups(ParallelConfig(pp=PP))
    stages = family.stages(config, PP, 1, layers_per_stage)
    generator = torch.Generator().manual_seed(0)
    data = []
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
        data.append(({"tokens": tokens[:, :-1].contiguous()}, tokens[:, 1:].contiguous()))

    def loss_fn(outputs, labels):  # the family's: its W rebuilds the output layer's gradient
        batch = {"labels": labels, "loss_mask": torch.ones(labels.shape)}
        return family.loss(outputs, batch, LossContext(config, kernels=kernels))[0]

    def boundary(index):
        return family.boundary(config, stages[index], MICRO_BATCH, groups.config, torch.float32)

    result = {}
    for schedule in ("1f1b", "zb-h1"):
        chunk = build_stage(family, config, stages[groups.pp.rank], groups=groups, seed=5)
        kernels = chunk.kernels
        setup_tied_weights([chunk], groups)
        losses = []

        def step(chunk=chunk, schedule=schedule, losses=losses):
            losses[:] = forward_backward(chunk, data, MICROBATCHES, loss_fn, groups, boundary=boundary,
                                         schedule=schedule)

        step()  # the gradients exist from here on: the measured step only accumulates into them
        result[schedule] = peak_allocated_bytes(step)
        result[f"{schedule} losses"] = [loss.item() for loss in losses]
    dist.barrier()
    return result


def test_zb_h1_holds_no_more_than_1f1b_on_any_rank(worlds):
    results = worlds.run(PP, peaks_per_schedule, "llama")
    one_f_one_b = [rank["1f1b"] for rank in results]
    zb_h1 = [rank["zb-h1"] for rank in results]
    shown = (f"peak MiB per rank: 1f1b {[round(b / 2**20, 3) for b in one_f_one_b]}, "
             f"zb-h1 {[round(b / 2**20, 3) for b in zb_h1]}")
    # The same step, split otherwise (the last stage's loss computed by another function under ZB-H1).
    torch.testing.assert_close(results[-1]["zb-h1 losses"], results[-1]["1f1b losses"], rtol=1e-6, atol=0)
    assert zb_h1[0] <= one_f_one_b[0], shown
    assert max(zb_h1) <= max(one_f_one_b), shown
    # The measure sees what held-back W keep: 1F1B's last rank holds one micro-batch, ZB-H1's pp.
    assert zb_h1[-1] > one_f_one_b[-1] + (PP - 2) * (one_f_one_b[-2] - one_f_one_b[-1]), shown
