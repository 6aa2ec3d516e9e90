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

VOCAB = 50257  # GPT-2's byte-level BPE, with a plain-text chat template
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
            "<|endoftext|>{% endgeneration %}{% else %}{{ m.content }}\n{% endif %}{% endfor %}")


@pytest.fixture
def chat_file(tmp_path, gpt2_files):
    def write(conversations: int) -> str:
        rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"{i}"}]}
                for i in range(conversations)]
        (tmp_path / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        (tmp_path / "template.jinja").write_text(TEMPLATE)
        assert mega(["preprocess", "--chat", "--input", str(tmp_path / "chat.jsonl"), "--output-prefix",
                     str(tmp_path / "chat"), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files[0],
                     "--merge-file", gpt2_files[1], "--chat-template", str(tmp_path / "template.jinja"),
                     "--workers", "1"]) == 0
        return str(tmp_path / "chat_messages_document")

    return write


def datasets(prefix: str, valid_samples: int, test_samples: int = 4):
    return sft_datasets(DatasetRequest(data_path=[prefix], split="969,30,1", seq_length=16, seed=1,
                                       num_samples=(8, valid_samples, test_samples), cache_path=None, tokenizer=None,
                                       vocab_size=VOCAB))


def test_an_empty_test_split_is_no_error(chat_file):
    data = datasets(chat_file(40), valid_samples=4)  # 39 to train, 1 to validate, none to test
    assert len(data.train) == 8 and len(data.valid) == 4 and data.test is None


def test_an_empty_validation_split_is_an_error_only_when_evaluated(chat_file):
    prefix = chat_file(10)  # 969,30,1 of 10 conversations: all 10 to train
    data = datasets(prefix, valid_samples=0)
    assert data.valid is None and data.test is None
    with pytest.raises(ValueError, match="the valid split of .* has no conversations: the file has 10 and --split "
                                         "969,30,1 gives the valid split none of them, .* give --split 9,1,0"):
        datasets(prefix, valid_samples=4)
    data = sft_datasets(DatasetRequest(data_path=[prefix], split="9,1,0", seq_length=16, seed=1,
                                       num_samples=(8, 4, 4), cache_path=None, tokenizer=None, vocab_size=VOCAB))
    assert len(data.valid) == 4  # the split the message gives works
