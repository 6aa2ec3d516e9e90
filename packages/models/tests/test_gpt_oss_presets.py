"""gpt-oss's presets: parameter and active-parameter counts against the model card (gpt-oss-20b:
20.91B, 3.61B active; gpt-oss-120b: 116.83B, 5.13B active), against the module built on the meta
device and transformers' ``GptOssForCausalLM`` on meta; the presets are the released config.json
files; ``mega train --model-preset ... --help`` shows the preset's values and ``mega plan`` prints
the memory of both shapes, whose model equals what one process's forward saves (2%). CPU only
(meta tensors, a tiny model's forward), so it passes on a GPU machine as well."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from mega.core.build import build_stage
from mega.core.parallel import ParallelConfig
from mega.models.gpt_oss.family import FAMILY, PRESETS

# Ours, exact (the model card rounds them: 20.91B / 3.61B and 116.83B / 5.13B).
COUNTS = {"20b": (20_914_757_184, 3_608_307_264), "120b": (116_829_156_672, 5_132_849_472)}
MODEL_CARD = {"20b": (20.91e9, 3.61e9), "120b": (116.83e9, 5.13e9)}
RELEASED = {"20b": dict(num_hidden_layers=24, num_local_experts=32), "120b": dict(num_hidden_layers=36,
                                                                                   num_local_experts=128)}


@pytest.mark.parametrize("preset", COUNTS)
def test_counts_match_the_model_card(preset):
    total, active = FAMILY.num_parameters(PRESETS[preset]), FAMILY.num_parameters(PRESETS[preset], active=True)
    assert (total, active) == COUNTS[preset]
    card_total, card_active = MODEL_CARD[preset]
    assert total == pytest.approx(card_total, abs=5e6) and active == pytest.approx(card_active, abs=5e6)


@pytest.mark.parametrize("preset", ["tiny", "20b"])
def test_the_count_equals_the_module_built_on_meta(preset):
    config = PRESETS[preset]
    for tp in (1, 2):
        model = build_stage(FAMILY, config, device="meta", parallel=ParallelConfig(tp=tp))
        padding = (config.padded_vocab_size(tp) - config.vocab_size) * config.hidden_size * 2
        assert sum(p.numel() for p in model.parameters()) - padding == FAMILY.num_parameters(config)


@pytest.mark.parametrize("preset", COUNTS)
def test_presets_are_the_released_configs_and_transformers_counts(preset):
    transformers = pytest.importorskip("transformers")
    from mega.models.gpt_oss.hf_gpt_oss import gpt_oss_config

    hf_config = transformers.GptOssConfig(**RELEASED[preset])  # transformers' defaults are the released shape
    assert gpt_oss_config(hf_config.to_dict()) == PRESETS[preset]
    with torch.device("meta"):
        hf_count = sum(p.numel() for p in transformers.GptOssForCausalLM(hf_config).parameters())
    assert hf_count == COUNTS[preset][0]


def test_train_help_shows_the_preset_and_plan_prints_the_published_shapes():
    from mega.train.command import main as train_main
    from mega.train.planning.plan_command import main as plan_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        train_main(["--model-family", "gpt-oss", "--model-preset", "20b", "--help"])
    text = " ".join(out.getvalue().split())
    for shown in ("number of transformer layers (default: 24)", "transformer hidden size (default: 2880)",
                  "experts per MoE layer (default: 32)", "(default: 201088)", "RoPE theta (default: 150000.0)",
                  "(default: learnable)", "(default: 128)", "(default: 7.0)"):
        assert shown in text, shown
    for preset, per_rank in (("20b", "4,187,440,704"), ("120b", "16,465,257,792")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert plan_main(["--model-family", "gpt-oss", "--model-preset", preset, "--bf16", "--gpus", "8",
                              "--expert-model-parallel-size", "8"]) == 0
        assert f"mega plan: gpt-oss {preset} on 8 GPUs" in out.getvalue() and per_rank in out.getvalue(), out.getvalue()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_memory_model_matches_one_process(dtype):
    """The sink attention's probabilities and repeated heads, the clamped SwiGLU's rows, the
    biases and sinks: the memory model against what a tiny model's forward and loss save."""
    import dataclasses

    from mega.testing.saved_activations import saved_activation_bytes

    config = dataclasses.replace(PRESETS["tiny"], vocab_size=256, seq_length=32)
    model = build_stage(FAMILY, config, seed=0, dtype=dtype)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(0))
    saved, _ = saved_activation_bytes(lambda: model.loss(model(tokens), tokens), exclude=list(model.parameters()))
    planned = FAMILY.memory_model(config, layers=config.num_layers, pre_process=True, post_process=True,
                                  parallel=ParallelConfig(), micro_batch_size=2, dtype_bytes=dtype.itemsize,
                                  device_type="cpu")
    assert planned.activation_bytes == pytest.approx(saved, rel=0.02)
    assert planned.parameters == sum(p.numel() for p in model.parameters())
