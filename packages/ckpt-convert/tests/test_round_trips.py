"""Conversions keep every tensor bit for bit: HF -> HF, HF -> mega (tp2 x pp2) -> mega (tp1,
resharded) -> HF, and back to tp2 x pp2; the Hugging Face outputs load with transformers'
Auto classes and compute what the original computes."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import TEXT, VARIANTS, hf_logits, input_ids, safetensors_of  # noqa: E402

transformers = pytest.importorskip("transformers")

from mega.ckpt_convert import WriteOptions, convert  # noqa: E402
from mega.core.checkpoint import read_metadata, read_tensors, tensor_shapes  # noqa: E402


def assert_same_tensors(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_to_hf_keeps_every_tensor_and_the_tokenizer(variant, hf_dirs, tmp_path):
    source, output = hf_dirs[variant], tmp_path / "hf"
    assert convert(source, output, to_format="hf") == []
    assert_same_tensors(safetensors_of(output), safetensors_of(source))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (output / name).read_bytes() == (source / name).read_bytes(), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_through_mega_layouts_round_trips_bit_for_bit(variant, hf_dirs, tmp_path):
    source = hf_dirs[variant]
    tp2pp2, tp1, back, again = (tmp_path / name for name in ("tp2pp2", "tp1", "hf", "tp2pp2-again"))
    convert(source, tp2pp2, to_format="mega", options=WriteOptions(tensor_parallel_size=2, pipeline_parallel_size=2))
    convert(tp2pp2, tp1, to_format="mega")  # reshard tp2 x pp2 -> tp1 x pp1
    convert(tp1, back, to_format="hf", options=WriteOptions(max_shard_bytes=40_000))  # sharded, with an index
    convert(tp1, again, to_format="mega", options=WriteOptions(tensor_parallel_size=2, pipeline_parallel_size=2))

    metadata = read_metadata(tp2pp2)
    family = "gpt" if variant.startswith("gpt2") else "llama"
    assert (metadata.layout["tp"], metadata.layout["pp"], metadata.model_family) == (2, 2, family)
    # 300 tokens pad to 512 rows for tp 2 (multiples of 128 * 2) and 384 for tp 1.
    assert tensor_shapes(tp2pp2)["embedding.word_embeddings.weight"][0][0] == 512
    assert tensor_shapes(tp1)["embedding.word_embeddings.weight"][0][0] == 384
    names = list(tensor_shapes(tp2pp2))
    assert_same_tensors(read_tensors(again, names), read_tensors(tp2pp2, names))

    assert (back / "model.safetensors.index.json").is_file() and not (back / "model.safetensors").exists()
    assert_same_tensors(safetensors_of(back), safetensors_of(source))
    ids = input_ids()
    assert torch.equal(hf_logits(back, ids), hf_logits(source, ids))
    original, converted = (transformers.AutoTokenizer.from_pretrained(d) for d in (source, back))
    assert converted(TEXT[0])["input_ids"] == original(TEXT[0])["input_ids"]
    assert converted.eos_token == original.eos_token == "<|endoftext|>"


def test_dtype_casts_floating_point_weights(hf_dirs, tmp_path):
    source, output = hf_dirs["llama-gqa-tied-bias"], tmp_path / "bf16"
    convert(source, output, to_format="hf", dtype=torch.bfloat16)
    expected = {name: tensor.to(torch.bfloat16) for name, tensor in safetensors_of(source).items()}
    assert_same_tensors(safetensors_of(output), expected)
    assert json.loads((output / "config.json").read_text())["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(output, dtype="auto")
    assert model.dtype == torch.bfloat16


def test_hub_style_gpt2_names_without_the_model_prefix(hf_dirs, tmp_path):
    """GPT-2 on the Hub was saved from the base model: ``h.0.attn...``, no ``transformer.``, plus
    its causal-mask buffers; both are understood."""
    from safetensors.torch import save_file

    source, hub, output = hf_dirs["gpt2-tied"], tmp_path / "hub", tmp_path / "hf"
    hub.mkdir()
    (hub / "config.json").write_bytes((source / "config.json").read_bytes())
    tensors = {name.removeprefix("transformer."): t for name, t in safetensors_of(source).items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    convert(hub, output, to_format="hf")
    assert_same_tensors(safetensors_of(output), safetensors_of(source))
