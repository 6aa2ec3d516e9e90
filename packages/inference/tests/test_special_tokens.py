"""Special tokens travel with the tokenizer: a checkpoint written with a Hugging Face
tokenizer.json keeps the eos/bos/pad its tokenizer_config.json declares, and ``mega convert``
to Hugging Face declares them (a bare tokenizer.json too), so transformers' AutoTokenizer (and
lm-evaluation-harness through it) knows the end of text."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import tiny_models  # noqa: E402,F401  (sets HF_HUB_OFFLINE)

transformers = pytest.importorskip("transformers")

from mega.ckpt_convert import convert  # noqa: E402
from mega.core.checkpoint import CheckpointMetadata, write_checkpoint  # noqa: E402
from mega.core.checkpoint.tokenizer_files import load_tokenizer  # noqa: E402
from mega.core.plugins import get_plugins  # noqa: E402
from mega.core.tokenizer import TokenizerOptions, TokenizerSpec  # noqa: E402
from mega.models.hf_mapping import hf_to_mega  # noqa: E402


def byte_tokenizer(directory, specials: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(directory / "tokenizer.json"))


def checkpoint_with(tokenizer_dir, directory):
    hf_model = tiny_models.hf_tiny("gpt2")
    family = get_plugins().models.get("gpt")
    config = family.hf_mapping.config_from_hf(hf_model.config.to_dict())
    spec = TokenizerSpec("HuggingFaceTokenizer", TokenizerOptions(tokenizer_model=str(tokenizer_dir / "tokenizer.json")))
    write_checkpoint(directory, CheckpointMetadata(0, "gpt", dataclasses.asdict(config)),
                     hf_to_mega(family.hf_mapping, hf_model.state_dict(), config), tokenizer=spec)


def test_declared_special_tokens_survive_checkpoint_and_conversion(tmp_path):
    source = tmp_path / "tokenizer"
    source.mkdir()
    byte_tokenizer(source, ["<|end|>", "<|start|>", "<|blank|>"])  # names no fallback list knows
    (source / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|end|>", "bos_token": "<|start|>", "pad_token": "<|blank|>"}))
    checkpoint_with(source, tmp_path / "ckpt")
    reloaded = load_tokenizer(tmp_path / "ckpt")
    assert (reloaded.eod, reloaded.bos, reloaded.pad) == (256, 257, 258)
    assert convert(tmp_path / "ckpt", tmp_path / "hf", to_format="hf") == []
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (hf.eos_token, hf.bos_token, hf.pad_token) == ("<|end|>", "<|start|>", "<|blank|>")


def test_a_bare_tokenizer_json_gets_its_end_of_text_declared(tmp_path):
    source = tmp_path / "tokenizer"
    source.mkdir()
    byte_tokenizer(source, ["<|endoftext|>"])
    checkpoint_with(source, tmp_path / "ckpt")
    assert convert(tmp_path / "ckpt", tmp_path / "hf", to_format="hf") == []
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == 256
