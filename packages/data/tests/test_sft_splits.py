"""Fine-tuning data and ``--split`` (issue 53, item 3): with the default ``969,30,1`` a small chat
file leaves the test split (which ``mega train`` never evaluates) or the validation split empty;
that is not an error unless the run evaluates that split, and then the message gives the file's
conversation count and a split that works. CPU only (no model)."""

from __future__ import annotations

import json

import pytest

from mega.core.cli.main import main as mega
from mega.core.datasets import DatasetRequest
from mega.data.sft_dataset import sft_datasets

VOCAB = 40
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }} "
            "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|end|>{% endgeneration %}"
            "{% else %}{{ m.content }}<|end|>{% endif %}{% endfor %}")


def chat_file(directory, conversations: int) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {str(i): i for i in range(VOCAB - 3)} | {"user": VOCAB - 3, "assistant": VOCAB - 2, "[UNK]": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|start|>", "<|end|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>", "chat_template": TEMPLATE}))
    rows = [{"messages": [{"role": "user", "content": f"{i % 30} 1"}, {"role": "assistant", "content": f"{i % 30}"}]}
            for i in range(conversations)]
    (directory / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert mega(["preprocess", "--chat", "--input", str(directory / "chat.jsonl"), "--output-prefix",
                 str(directory / "chat"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                 str(directory), "--workers", "1"]) == 0
    return str(directory / "chat_messages_document")


def datasets(prefix: str, valid_samples: int, test_samples: int = 4):
    return sft_datasets(DatasetRequest(data_path=[prefix], split="969,30,1", seq_length=16, seed=1,
                                       num_samples=(8, valid_samples, test_samples), cache_path=None, tokenizer=None,
                                       vocab_size=VOCAB + 2))


def test_an_empty_test_split_is_no_error(tmp_path):
    data = datasets(chat_file(tmp_path, 40), valid_samples=4)  # 39 to train, 1 to validate, none to test
    assert len(data.train) == 8 and len(data.valid) == 4 and data.test is None


def test_an_empty_validation_split_is_an_error_only_when_evaluated(tmp_path):
    prefix = chat_file(tmp_path, 10)  # 969,30,1 of 10 conversations: all 10 to train
    data = datasets(prefix, valid_samples=0)
    assert data.valid is None and data.test is None
    with pytest.raises(ValueError, match="the valid split of .* has no conversations: the file has 10 and --split "
                                         "969,30,1 gives the valid split none of them, .* give --split 9,1,0"):
        datasets(prefix, valid_samples=4)
    data = sft_datasets(DatasetRequest(data_path=[prefix], split="9,1,0", seq_length=16, seed=1,
                                       num_samples=(8, 4, 4), cache_path=None, tokenizer=None, vocab_size=VOCAB + 2))
    assert len(data.valid) == 4  # the split the message gives works
