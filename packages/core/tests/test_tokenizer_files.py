"""CPU. A checkpoint carries its run's tokenizer: a Hugging Face tokenizer given as its directory
travels as the directory's tokenizer.json (and the files describing its tokens), and the
checkpoint's record names that file, so generation from the checkpoint finds it."""

from __future__ import annotations

import json
from types import SimpleNamespace

from mega.core.checkpoint.tokenizer_files import copy_tokenizer_files, tokenizer_entry, tokenizer_spec
from mega.core.tokenizer import TokenizerOptions, TokenizerSpec


def test_a_tokenizer_directory_travels_as_its_tokenizer_json(tmp_path):
    source = tmp_path / "my-tokenizer"
    source.mkdir()
    (source / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    spec = TokenizerSpec("HuggingFaceTokenizer", TokenizerOptions(tokenizer_model=str(source)))
    checkpoint = tmp_path / "ckpt"
    copy_tokenizer_files(spec, checkpoint)
    entry = tokenizer_entry(spec)

    assert sorted(p.name for p in (checkpoint / "tokenizer").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert entry["options"]["tokenizer_model"] == "tokenizer.json"
    loaded = tokenizer_spec(checkpoint, SimpleNamespace(tokenizer=entry))
    assert loaded.options.tokenizer_model == str(checkpoint / "tokenizer" / "tokenizer.json")
