"""The ``gpt-oss`` family against transformers' ``GptOssForCausalLM`` with every feature on
(attention sinks, sliding-window layers alternating with full ones under a window shorter than the
sequence, YaRN rotary, clamped SwiGLU experts with biases, a biased router; 4 experts, top-2,
GQA). CPU, fp32, one process (gloo worlds where said).

Hugging Face -> mega -> Hugging Face is bit-exact; the logits and loss equal transformers' (1e-5);
a checkpoint whose experts are stored as MXFP4 blocks and scales (transformers' layout) converts
to the logits of the dequantized model; greedy generation equals transformers' ``generate``."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import VOCAB, input_ids, save_hf_model  # noqa: E402

transformers = pytest.importorskip("transformers")

from mega.ckpt_convert import convert  # noqa: E402

WINDOW = 4  # shorter than the tests' sequences (16 tokens, prompts of 7-9 and 32 new tokens)


def make_gpt_oss(seed: int = 16):
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=128, initializer_range=0.1, swiglu_limit=0.5,  # low: the clamp acts
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 32, "rope_theta": 150000.0})
    assert config.layer_types == ["sliding_attention", "full_attention"]
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1, biases and sinks at 0: make every value count
        for name, param in model.named_parameters():
            if param.dim() == 1 or name.endswith("_bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="module")
def hf_model():
    return make_gpt_oss()


@pytest.fixture(scope="module")
def converted(hf_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    hf_dir = save_hf_model(hf_model, root / "hf")
    mega_dir = root / "mega"
    convert(hf_dir, mega_dir, to_format="mega")
    return hf_dir, mega_dir


def hf_logits(model, ids):
    with torch.no_grad():
        out = model(ids, labels=ids)
    return out.logits, out.loss


def test_one_process_logits_equal_transformers(hf_model, converted, assert_close):
    from test_layout_logits import stage_logits

    from mega.core.parallel import ParallelConfig, ParallelGroups

    ids = input_ids()
    logits, loss = stage_logits(str(converted[1]), ids, ParallelGroups(ParallelConfig()))
    expected, expected_loss = hf_logits(hf_model, ids)
    assert_close(logits, expected, what="gpt-oss")
    assert_close(loss, expected_loss, what="gpt-oss loss")


def test_mega_to_hugging_face_is_bit_exact(converted, tmp_path):
    from safetensors.torch import load_file

    hf_dir, mega_dir = converted
    convert(mega_dir, tmp_path / "back", to_format="hf")
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
