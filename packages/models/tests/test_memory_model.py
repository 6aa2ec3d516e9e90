"""The family's memory model against the tensors one process's forward really saves for backward.

(tests/test_plan_vs_training.py does the same on gloo ranks, inside a real Trainer.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mega.core.build import build_stage
from mega.core.parallel import ParallelConfig
from mega.models.gpt.family import FAMILY as GPT_FAMILY
from mega.models.gpt.family import PRESETS as GPT
from mega.models.llama.family import FAMILY as LLAMA_FAMILY
from mega.models.llama.family import PRESETS as LLAMA
from mega.models.memory import stage_footprint, stage_parameters
from mega.testing.saved_activations import saved_activation_bytes

RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full uniform": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    "full block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_saved_activations_match_the_memory_model(family, recompute, dtype):
    base = GPT["tiny"] if family == "gpt" else LLAMA["tiny"]
    config = dataclasses.replace(base, num_layers=4, vocab_size=256, hidden_dropout=0.1, attention_dropout=0.0,
                                 **RECOMPUTE[recompute])
    torch.manual_seed(0)
    model = build_stage(GPT_FAMILY if family == "gpt" else LLAMA_FAMILY, config, seed=0, dtype=dtype)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length))
    saved, _ = saved_activation_bytes(lambda: model.loss(model(tokens), tokens), exclude=list(model.parameters()))
    planned = stage_footprint(config, layers=4, pre_process=True, post_process=True, parallel=ParallelConfig(),
                              micro_batch_size=2, dtype_bytes=dtype.itemsize, device_type="cpu")
    assert planned.activation_bytes == pytest.approx(saved, rel=0.02)
    assert (planned.recompute_bytes > 0) == recompute.startswith("full")


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_stages_add_up_to_the_model(family):
    config = (GPT if family == "gpt" else LLAMA)["tiny"]
    whole = stage_parameters(config, config.num_layers, pre_process=True, post_process=True)
    assert whole == sum(p.numel() for p in build_stage(GPT_FAMILY if family == "gpt" else LLAMA_FAMILY, config, device="meta").parameters())
    first = stage_parameters(config, 1, pre_process=True, post_process=False)
    last = stage_parameters(config, 1, pre_process=False, post_process=True)
    tied_copy = 0 if config.untie_embeddings_and_output_weights else config.padded_vocab_size() * config.hidden_size
    assert first + last == whole + tied_copy  # a later stage holds its own copy of a tied embedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "deepseek-v3"])
def test_moe_families_memory_model_matches_one_process(family, dtype):
    """CPU, one process: the MoE families' memory model (mega.models.mixtral.memory) against what a
    whole model's forward and loss save (DeepSeek-V3: MLA, its dense first layer, the shared
    experts and the MTP module's losses) and the parameters it holds."""
    from mega.core.plugins import get_plugins

    plugin = get_plugins().models.get(family)
    config = dataclasses.replace(plugin.presets["tiny"], vocab_size=256, seq_length=32)
    model = build_stage(plugin, config, seed=0, dtype=dtype)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(0))

    def forward():
        if getattr(model, "mtp", None) is None:
            return model.loss(model(tokens), tokens)
        outputs = model({"tokens": tokens})
        return [model.loss(logits, tokens) for logits in (outputs["logits"], *outputs["mtp_logits"])]

    saved, _ = saved_activation_bytes(forward, exclude=list(model.parameters()))
    planned = plugin.memory_model(config, layers=config.num_layers, pre_process=True, post_process=True,
                                  parallel=ParallelConfig(), micro_batch_size=2, dtype_bytes=dtype.itemsize,
                                  device_type="cpu")
    assert planned.activation_bytes == pytest.approx(saved, rel=0.02)
    assert planned.parameters == sum(p.numel() for p in model.parameters())
