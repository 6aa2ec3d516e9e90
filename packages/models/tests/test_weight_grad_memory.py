"""``mega plan``'s ``weight_grad_bytes`` (what a micro-batch holds from its B to its W under a
zero-bubble schedule) against what the deferred products really hold (CPU, one process, fp32).

The last stage of a two-stage split (two layers, the final norm, the output layer and the loss)
runs one micro-batch forward inside ``deferring_weight_grads``, as a zero-bubble schedule's F
does, and backward (B); the storages the pending products keep, the parameters aside
(mega.testing.held_for_w), are compared with the family's memory model. Dense layers
(GPT with biases, LLaMA with grouped queries, Qwen3 with QK-norm), experts (Mixtral: the loop over
experts) and DeepSeek-V3 (multi-latent attention, a dense first layer, shared experts, the
multi-token prediction head whose output layer keeps its logits' gradient).
"""

from __future__ import annotations

import pytest
import torch

from mega.core.build import build_stage
from mega.core.model_family import LossContext
from mega.core.parallel import ParallelConfig, ParallelGroups
from mega.core.parallel.weight_grad_split import deferring_weight_grads
from mega.models.deepseek_v3.family import FAMILY as DEEPSEEK
from mega.models.gpt.family import FAMILY as GPT
from mega.models.llama.family import FAMILY as LLAMA
from mega.models.mixtral.family import FAMILY as MIXTRAL
from mega.models.qwen3.family import FAMILY as QWEN3
from mega.testing.held_for_w import bytes_held_for_w

SEQ, MICRO_BATCH = 32, 2
FAMILIES = {"gpt": GPT, "llama": LLAMA, "qwen3": QWEN3, "mixtral": MIXTRAL, "deepseek-v3": DEEPSEEK}
# DeepSeek-V3: the last stage's first layer dense, its second MoE
OVERRIDES = {"deepseek-v3": {"moe_layer_freq": "[0]*3+[1]*1"}}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_planned_weight_grad_bytes_are_what_the_deferred_products_hold(name):  # device: cpu
    family = FAMILIES[name]
    config = family.preset("tiny", num_layers=4, seq_length=SEQ, max_position_embeddings=SEQ, hidden_dropout=0.0,
                           attention_dropout=0.0, **OVERRIDES.get(name, {}))
    stage = family.stages(config, 2, 1, None)[1]
    groups = ParallelGroups(ParallelConfig())
    model = build_stage(family, config, stage, groups=groups, seed=0, device="cpu")  # the CPU on a GPU machine too
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (MICRO_BATCH, SEQ + 1), generator=generator)
    hidden = torch.randn(SEQ, MICRO_BATCH, config.hidden_size, generator=generator, requires_grad=True)
    batch = {"labels": tokens[:, 1:], "loss_mask": torch.ones(MICRO_BATCH, SEQ)}
    pending = []
    with deferring_weight_grads(pending):
        outputs = model({"hidden": hidden, "tokens": tokens[:, :-1]})
        loss, _ = family.loss(outputs, batch, LossContext(config, kernels=model.kernels))
    loss.backward()
    measured = bytes_held_for_w(pending, model.parameters())
    layers = stage.layers["decoder"]
    planned = family.memory_model(config, layers=len(layers), first_layer=layers.start, pre_process=False,
                                  post_process=True, parallel=groups.config, micro_batch_size=MICRO_BATCH,
                                  dtype_bytes=4, device_type="cpu").weight_grad_bytes
    assert abs(planned - measured) <= 0.02 * measured, (name, planned, measured)
