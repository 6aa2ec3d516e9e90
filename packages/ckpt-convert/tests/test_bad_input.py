"""Bad input gives one clear error naming the file or field, exit status 1, and no output
directory (nor a hidden partial one) left behind."""

from __future__ import annotations

import json
import re
import shutil

import pytest

pytest.importorskip("transformers")

from mega.ckpt_convert import WriteOptions, convert  # noqa: E402
from mega.ckpt_convert.cli import main  # noqa: E402


def fails(capsys, tmp_path, *args: str, output: str = "out") -> str:
    """Run ``mega convert ... --output tmp_path/output``; the error text, after checking that
    nothing was left behind."""
    target = tmp_path / output
    existed = target.exists()
    assert main([*args, "--output", str(target)]) == 1
    error = capsys.readouterr().err
    assert error.count("error:") == 1, error
    assert "no output was written" in error
    assert target.exists() == existed
    assert not list(tmp_path.glob(f".{output}.partial-*"))
    return error


def copy_of(hf_dirs, tmp_path, variant="llama-gqa-tied-bias", name="in"):
    return shutil.copytree(hf_dirs[variant], tmp_path / name)


def edit_config(directory, **changes):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_not_a_checkpoint(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    assert "not a checkpoint of a known format" in fails(capsys, tmp_path, "--to", "mega", "--input", str(tmp_path / "empty"))
    assert "config.json is missing" in fails(capsys, tmp_path, "--from", "hf", "--to", "mega",
                                             "--input", str(tmp_path / "empty"))


@pytest.mark.parametrize("change, message", [
    ({"intermediate_size": 128}, r"model.layers.0.mlp.gate_proj.weight has shape \[96, 64\], but .*config.json implies \[128, 64\]"),
    ({"num_hidden_layers": 3}, "lacks model.layers.2.input_layernorm.weight"),
    ({"num_hidden_layers": 1}, "holds model.layers.1."),
    ({"tie_word_embeddings": False}, "lacks lm_head.weight"),
    ({"architectures": ["BloomForCausalLM"], "model_type": "bloom"}, r"unsupported architecture \['BloomForCausalLM'\]; "
                                                                    r"mega converts .*GPT2LMHeadModel \(gpt\).*LlamaForCausalLM \(llama\)"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not SwiGLU's silu"),
])
def test_config_that_does_not_match_the_weights(change, message, hf_dirs, capsys, tmp_path):
    source = copy_of(hf_dirs, tmp_path)
    edit_config(source, **change)
    error = fails(capsys, tmp_path, "--to", "mega", "--input", str(source))
    assert re.search(message, error), error


def test_missing_and_damaged_weight_files(hf_dirs, capsys, tmp_path):
    sharded = tmp_path / "sharded"
    convert(hf_dirs["gpt2-untied"], sharded, to_format="hf", options=WriteOptions(max_shard_bytes=50_000))
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dropped = index["weight_map"].pop("transformer.h.0.ln_1.bias")
    index_path.write_text(json.dumps(index))
    assert f"{dropped} holds transformer.h.0.ln_1.bias, which model.safetensors.index.json does not list" in fails(
        capsys, tmp_path, "--to", "hf", "--input", str(sharded))
    index["weight_map"]["transformer.h.0.ln_1.bias"] = index["weight_map"]["transformer.wte.weight"]
    index_path.write_text(json.dumps(index))
    assert "places transformer.h.0.ln_1.bias in" in fails(capsys, tmp_path, "--to", "hf", "--input", str(sharded))
    shards = sorted(sharded.glob("model-*.safetensors"))
    shards[1].unlink()
    assert f"names {shards[1].name}, which is missing" in fails(capsys, tmp_path, "--to", "hf", "--input", str(sharded))

    single = copy_of(hf_dirs, tmp_path, name="truncated")
    weights = single / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert "the file is truncated or corrupt" in fails(capsys, tmp_path, "--to", "hf", "--input", str(single))

    pickled = copy_of(hf_dirs, tmp_path, name="pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    assert "pytorch_model.bin (a pickle), which mega does not load" in fails(capsys, tmp_path, "--to", "hf",
                                                                              "--input", str(pickled))


def test_family_and_layout_errors(hf_dirs, capsys, tmp_path):
    source = str(hf_dirs["llama-gqa-tied-bias"])
    assert "--model-family gpt is GPT2LMHeadModel" in fails(capsys, tmp_path, "--to", "mega", "--input", source,
                                                             "--model-family", "gpt")
    assert "no model 'gtp'; did you mean gpt?" in fails(capsys, tmp_path, "--to", "mega", "--input", source, "--model-family", "gtp")
    assert "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4" in fails(
        capsys, tmp_path, "--to", "mega", "--input", source, "--target-tensor-parallel-size", "4")
    assert "--target-pipeline-parallel-size 3: cannot split 2 layers into pp*vpp = 3" in fails(
        capsys, tmp_path, "--to", "mega", "--input", source, "--target-pipeline-parallel-size", "3")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("mine")
    assert "already exists and is not empty" in fails(capsys, tmp_path, "--to", "hf", "--input", source, output="taken")
    assert (tmp_path / "taken" / "file").read_text() == "mine"


def test_tensor_parallel_size_is_for_mega_outputs_only(hf_dirs, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["--to", "hf", "--input", str(hf_dirs["gpt2-tied"]), "--output", str(tmp_path / "out"),
              "--target-tensor-parallel-size", "2"])
    assert exit_info.value.code == 2
    assert "applies to mega and megatron outputs only" in capsys.readouterr().err


def test_mega_checkpoints_damaged_or_not_expressible_in_transformers(hf_dirs, capsys, tmp_path):
    mega = tmp_path / "mega"
    convert(hf_dirs["llama-mha-untied"], mega, to_format="mega")
    metadata_path = mega / "release" / "mega_checkpoint.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["model_config"]["softmax_scale"] = 0.5
    metadata_path.write_text(json.dumps(metadata))
    assert "LlamaForCausalLM cannot express this model: softmax_scale" in fails(capsys, tmp_path, "--to", "hf",
                                                                                 "--input", str(mega))
    metadata["model_config"]["hidden_size"] = 128
    metadata_path.write_text(json.dumps(metadata))
    assert "has shape [384, 64], but the model config implies [384, 128]" in fails(capsys, tmp_path, "--to", "hf",
                                                                                    "--input", str(mega))
    (mega / "release" / "__0_0.distcp").unlink()
    assert "is incomplete: __0_0.distcp is missing" in fails(capsys, tmp_path, "--to", "hf", "--input", str(mega))


def test_a_weight_whose_header_says_integer_is_refused(hf_dirs, capsys, tmp_path):
    """An F32 tensor relabelled I32 (same size) would convert to an integer model weight."""
    source = copy_of(hf_dirs, tmp_path)
    weights = source / "model.safetensors"
    data = weights.read_bytes()
    relabelled = data.replace(b'"model.norm.weight":{"dtype":"F32"', b'"model.norm.weight":{"dtype":"I32"')
    assert relabelled != data
    weights.write_bytes(relabelled)
    error = fails(capsys, tmp_path, "--to", "mega", "--input", str(source))
    assert "model.safetensors: model.norm.weight is stored as int32; a model weight must be floating point" in error
