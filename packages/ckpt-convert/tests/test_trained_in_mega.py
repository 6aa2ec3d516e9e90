"""A model trained a few steps with ``mega train`` and converted to Hugging Face computes, in
transformers, the logits mega computes; its tokenizer comes along and tokenizes alike."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import TEXT, VOCAB, hf_logits, input_ids, make_tokenizer  # noqa: E402

transformers = pytest.importorskip("transformers")

from mega.ckpt_convert.cli import main as convert_main  # noqa: E402
from mega.core.build import build_stage  # noqa: E402
from mega.core.checkpoint import load_model_weights, load_tokenizer, read_metadata  # noqa: E402
from mega.core.plugins import get_plugins  # noqa: E402
from mega.train.command import main as train_main  # noqa: E402


def mega_logits(checkpoint, ids: torch.Tensor) -> torch.Tensor:
    metadata = read_metadata(checkpoint)
    family = get_plugins().models.get(metadata.model_family)
    config = family.config_class(**metadata.model_config)
    model = build_stage(family, config)
    load_model_weights(checkpoint, [model.eval()])
    with torch.no_grad():
        return model(ids).transpose(0, 1)[..., : config.vocab_size]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_trained_model_converted_to_hugging_face_computes_the_same(family, tmp_path, assert_close):
    make_tokenizer().model.save(str(tmp_path))  # vocab.json and merges.txt of a byte-level BPE
    save, output = tmp_path / "save", tmp_path / "hf"
    assert train_main([
        "--model-family", family, "--model-preset", "tiny", "--num-layers", "2", "--vocab-size", str(VOCAB),
        "--seq-length", "16", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "3", "--lr", "1e-2", "--eval-iters", "0", "--split", "100,0,0", "--save", str(save),
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json"),
        "--merge-file", str(tmp_path / "merges.txt"),
    ]) == 0
    assert read_metadata(save).iteration == 3
    assert convert_main(["--to", "hf", "--input", str(save), "--output", str(output)]) == 0

    ids = input_ids()
    assert_close(hf_logits(output, ids), mega_logits(save, ids), what=f"{family} logits")
    tokenizer = transformers.AutoTokenizer.from_pretrained(output)
    for text in TEXT:
        assert tokenizer(text)["input_ids"] == load_tokenizer(save).tokenize(text)
