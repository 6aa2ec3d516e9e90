"""Hugging Face directories go back as they came (issue 37): a headless decoder class of each family
is converted as itself (GPT2Model) or refused naming the class to convert (LlamaModel, MixtralModel:
an untied decoder without its lm_head); a tensor the conversion would not use (a tied lm_head that
differs from the embedding) is an error naming it, or a warning with --allow-unused-tensors; a copy
that is one is carried back. Checked with transformers' own classes and safetensors."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import safetensors_of  # noqa: E402

transformers = pytest.importorskip("transformers")

from mega.ckpt_convert import ConversionError, WriteOptions, convert  # noqa: E402
from mega.ckpt_convert.cli import main as convert_main  # noqa: E402


def _save(model, directory: Path) -> Path:
    torch.manual_seed(1)
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1: make every value count
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return directory


def test_gpt2_model_round_trips_as_itself(tmp_path):
    config = transformers.GPT2Config(vocab_size=200, n_embd=64, n_layer=2, n_head=4, n_positions=32)
    source = _save(transformers.GPT2Model(config).eval(), tmp_path / "source")
    convert(source, tmp_path / "mega", to_format="mega", options=WriteOptions(tensor_parallel_size=2))
    convert(tmp_path / "mega", tmp_path / "hf", to_format="hf")
    original, written = safetensors_of(source), safetensors_of(tmp_path / "hf")
    assert set(written) == set(original) and "wte.weight" in written
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["GPT2Model"]
    ids = torch.randint(0, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = transformers.GPT2Model.from_pretrained(tmp_path / "hf").eval()(ids).last_hidden_state
        want = transformers.GPT2Model.from_pretrained(source).eval()(ids).last_hidden_state
    assert torch.equal(got, want)


@pytest.mark.parametrize(("headless", "headed"), [("LlamaModel", "LlamaForCausalLM"),
                                                  ("MixtralModel", "MixtralForCausalLM")])
def test_headless_llama_and_mixtral_are_refused_naming_the_class(headless, headed, tmp_path):
    config_class = getattr(transformers, headless.replace("Model", "Config"))
    config = config_class(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                          **({"num_local_experts": 2} if headless == "MixtralModel" else {}))
    source = _save(getattr(transformers, headless)(config).eval(), tmp_path / "source")
    with pytest.raises(ConversionError, match=f"{headless} is the base model alone.*{headed}"):
        convert(source, tmp_path / "mega", to_format="mega")
    assert not (tmp_path / "mega").exists()


def test_a_tied_lm_head_is_checked_against_the_embedding(hf_dirs, tmp_path, capsys):
    from safetensors.torch import save_file

    source = hf_dirs["llama-gqa-tied-bias"]
    tensors = safetensors_of(source)
    for case, head in (("copy", tensors["model.embed_tokens.weight"].clone()),
                       ("other", torch.randn_like(tensors["model.embed_tokens.weight"]))):
        directory = tmp_path / case
        shutil.copytree(source, directory)
        for path in directory.glob("*.safetensors"):
            path.unlink()
        save_file({**tensors, "lm_head.weight": head}, directory / "model.safetensors", metadata={"format": "pt"})
    # the same tensor twice: converted once, written back as it came
    convert(tmp_path / "copy", tmp_path / "copy-mega", to_format="mega")
    convert(tmp_path / "copy-mega", tmp_path / "copy-hf", to_format="hf")
    written = safetensors_of(tmp_path / "copy-hf")
    assert set(written) == set(tensors) | {"lm_head.weight"}
    assert torch.equal(written["lm_head.weight"], tensors["model.embed_tokens.weight"])
    # another tensor: the config ties it, so the conversion would drop it
    with pytest.raises(ConversionError, match="lm_head.weight.*--allow-unused-tensors"):
        convert(tmp_path / "other", tmp_path / "refused", to_format="mega")
    assert not (tmp_path / "refused").exists()
    assert convert_main(["--to", "mega", "--input", str(tmp_path / "other"), "--output", str(tmp_path / "allowed"),
                         "--allow-unused-tensors", "--progress", "never"]) == 0
    assert "lm_head.weight" in capsys.readouterr().err
