"""Preset sizes (against published figures and Hugging Face's models built on the meta device),
the analytical parameter count against the built module, and Megatron's FLOPs formula."""

from __future__ import annotations

import pytest
import torch

from mega.core.build import build_stage
from mega.core.parallel import ParallelConfig
from mega.models.flops import num_floating_point_operations
from mega.models.gpt.family import FAMILY as GPT
from mega.models.llama.family import FAMILY as LLAMA
from mega.models.parameter_count import num_parameters

# Published sizes: GPT-3 paper (nominal), Hugging Face model cards (exact).
PUBLISHED = {
    ("gpt", "125m"): 125e6, ("gpt", "350m"): 350e6, ("gpt", "760m"): 760e6, ("gpt", "1.3b"): 1.3e9,
    ("gpt", "2.7b"): 2.7e9, ("gpt", "6.7b"): 6.7e9, ("gpt", "13b"): 13e9, ("gpt", "175b"): 175e9,
    ("llama", "llama2-7b"): 6_738_415_616, ("llama", "llama2-13b"): 13_015_864_320,
    ("llama", "llama2-70b"): 68_976_648_192, ("llama", "llama3-8b"): 8_030_261_248,
    ("llama", "llama3-70b"): 70_553_706_496, ("llama", "llama3-405b"): 405_853_388_800,
}


@pytest.mark.parametrize(("family", "preset"), PUBLISHED, ids=[f"{f}-{p}" for f, p in PUBLISHED])
def test_preset_sizes_match_published_figures(family, preset):
    count = num_parameters((GPT if family == "gpt" else LLAMA).presets[preset])
    published = PUBLISHED[(family, preset)]
    if family == "llama":
        assert count == published  # vocabularies 32000 and 128256 need no padding
    else:
        assert count == pytest.approx(published, rel=0.05)


@pytest.mark.parametrize("family", [GPT, LLAMA], ids=["gpt", "llama"])
def test_analytical_count_equals_the_module_built_on_meta(family):
    for name, config in family.presets.items():
        for tp in (1, 2):  # tp changes the vocabulary padding
            model = build_stage(family, config, device="meta", parallel=ParallelConfig(tp=tp))
            assert sum(p.numel() for p in model.parameters()) == num_parameters(config, tp), (name, tp)


def test_llama_counts_equal_hugging_face_models_on_meta():
    transformers = pytest.importorskip("transformers")
    from mega.models.llama.hf_llama import llama_config

    shapes = {"llama2-7b": (4096, 11008, 32, 32, 32, 32000), "llama3-8b": (4096, 14336, 32, 32, 8, 128256)}
    for preset, (hidden, ffn, layers, heads, groups, vocab) in shapes.items():
        hf_config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                                             num_attention_heads=heads, num_key_value_heads=groups, vocab_size=vocab)
        with torch.device("meta"):
            hf_count = sum(p.numel() for p in transformers.LlamaForCausalLM(hf_config).parameters())
        assert num_parameters(llama_config(hf_config.to_dict())) == hf_count == num_parameters(LLAMA.presets[preset])


def test_gpt_count_equals_hugging_face_gpt2_on_meta():
    transformers = pytest.importorskip("transformers")
    config = GPT.presets["1.3b"]
    hf_config = transformers.GPT2Config(n_embd=config.hidden_size, n_layer=config.num_layers,
                                        n_head=config.num_attention_heads, n_positions=config.seq_length,
                                        vocab_size=config.vocab_size)
    with torch.device("meta"):
        hf_count = sum(p.numel() for p in transformers.GPT2LMHeadModel(hf_config).parameters())
    padding = (config.padded_vocab_size() - config.vocab_size) * config.hidden_size
    assert num_parameters(config) == hf_count + padding


def test_flops_equal_the_classic_closed_form_for_a_plain_gpt():
    config = GPT.presets["1.3b"]
    B, s, L, h = 512, config.seq_length, config.num_layers, config.hidden_size
    V = config.vocab_size  # the real vocabulary: padded rows are no useful work (Megatron counts them)
    classic = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert num_floating_point_operations(config, B, causal=False) == pytest.approx(classic, rel=1e-12)
    # Megatron counts the causal half of the attention scores: s/(6h) becomes s/(12h).
    causal = 72 * B * s * L * h**2 * (1 + s / (12 * h) + V / (12 * L * h))
    assert num_floating_point_operations(config, B) == pytest.approx(causal, rel=1e-12)


def test_flops_follow_megatrons_expression_with_gqa_and_swiglu():
    config = LLAMA.presets["llama3-8b"]
    B, s, L, h = 8, config.seq_length, config.num_layers, config.hidden_size
    n, g, F = config.num_attention_heads, config.num_query_groups, config.ffn_hidden_size
    V, q_ratio = config.vocab_size, config.query_projection_size / h
    # megatron/training/training.py: num_floating_point_operations, dense layers (with the real
    # vocabulary where Megatron takes the padded one).
    megatron = 12 * B * s * L * h**2 * (
        (1 + g / n + s / h / 2) * q_ratio + (F / h) * 1.5 + V / (2 * L * h)
    )
    assert num_floating_point_operations(config, B) == pytest.approx(megatron, rel=1e-12)
