"""``mega preprocess --chat``: assistant masks equal transformers' ``apply_chat_template`` on GPT-2's
real vocabulary (with ChatML's special tokens added), and bad conversations name their line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mega.core.cli.main import main as mega
from mega.data.chat_encoder import LOSS_MASK_SUFFIX
from mega.data.indexed_dataset import IndexedDataset

# ChatML, as SmolLM3 and Qwen write it, with the assistant's part in {% generation %} blocks.
GENERATION_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{%- elif message['role'] in ['system', 'user'] -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- else -%}{{ raise_exception('unknown role ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
PLAIN_TEMPLATE = GENERATION_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "You answer briefly."},
                  {"role": "user", "content": "What is a list?"},
                  {"role": "assistant", "content": "An ordered, mutable sequence."},
                  {"role": "user", "content": "And a tuple?"},
                  {"role": "assistant", "content": " An immutable one: (1, 2)."}]},
    {"prompt": "Name a keyword.", "response": "lambda\n\nor def"},
    {"messages": [{"role": "user", "content": "héllo wörld ✓"}, {"role": "assistant", "content": "¿qué?"}]},
]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory, gpt2_files):
    """A tokenizer.json of GPT-2's BPE plus ChatML's tokens, with a chat template in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = gpt2_files
    tokenizer = Tokenizer(models.BPE.from_file(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    directory = tmp_path_factory.mktemp("chat-tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": GENERATION_TEMPLATE}))
    return directory


def messages_of(row):
    if "messages" in row:
        return row["messages"]
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]


def transformers_masks(directory, template):
    """ids and assistant masks as transformers computes them: its {% generation %} tracking, or
    (a template without it) each assistant turn as the text it adds after the generation prompt."""
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), chat_template=template)
    results = []
    for row in CONVERSATIONS:
        messages = messages_of(row)
        if "{% generation %}" in template:
            out = reference.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            results.append((out["input_ids"], out["assistant_masks"]))
            continue
        text = reference.apply_chat_template(messages, tokenize=False)
        encoding = reference(text, add_special_tokens=False)
        mask = [0] * len(encoding["input_ids"])
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(reference.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True))
            end = len(reference.apply_chat_template(messages[: i + 1], tokenize=False))
            for token, (a, b) in enumerate(encoding.encodings[0].offsets):
                if a < end and b > start:
                    mask[token] = 1
        results.append((encoding["input_ids"], mask))
    return results


def preprocess_chat(tmp_path, directory, rows, *extra, tokenizer_type="HuggingFaceTokenizer"):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    prefix = tmp_path / "out" / "chat"
    code = mega(["preprocess", "--chat", "--input", str(path), "--output-prefix", str(prefix), "--workers", "1",
                 "--tokenizer-type", tokenizer_type, "--tokenizer-model", str(directory), *extra])
    return code, f"{prefix}_messages_document", path


@pytest.mark.parametrize("template", ["generation", "plain"])
def test_masks_equal_transformers(tmp_path, chat_tokenizer, template):
    source = GENERATION_TEMPLATE if template == "generation" else PLAIN_TEMPLATE
    extra = []
    if template == "plain":
        (tmp_path / "plain.jinja").write_text(source)
        extra = ["--chat-template", str(tmp_path / "plain.jinja")]
    code, prefix, _ = preprocess_chat(tmp_path, chat_tokenizer, CONVERSATIONS, *extra)
    assert code == 0
    tokens, masks = IndexedDataset(prefix), IndexedDataset(prefix + LOSS_MASK_SUFFIX)
    assert masks.dtype == np.uint8 and len(tokens) == len(masks) == len(CONVERSATIONS)
    for i, (ids, mask) in enumerate(transformers_masks(chat_tokenizer, source)):
        assert tokens[i].tolist() == ids
        assert masks[i].tolist() == mask
        assert 0 < sum(mask) < len(mask)


BAD_ROWS = [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
     "message 2 is an empty assistant turn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]},
     "message 2 has role 'bot', which the chat template does not know"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "marks no assistant tokens"),
    ({"text": "hi"}, "no field 'messages' and no prompt/response pair"),
    ({"prompt": "a " * 40, "response": "b"}, "more than --seq-length 32"),
]


def test_bad_conversations_name_file_and_line(tmp_path, chat_tokenizer, capsys):
    rows = [CONVERSATIONS[1], *(row for row, _ in BAD_ROWS)]
    code, prefix, path = preprocess_chat(tmp_path, chat_tokenizer, rows, "--seq-length", "32")
    assert code == 1
    assert f"{path}:2: {BAD_ROWS[0][1]}" in capsys.readouterr().err
    assert not list((tmp_path / "out").glob("*.bin"))
    code, prefix, path = preprocess_chat(tmp_path, chat_tokenizer, rows, "--seq-length", "32", "--skip-bad-lines")
    assert code == 0 and len(IndexedDataset(prefix)) == 1
    reported = capsys.readouterr().err.splitlines()
    for line, (_, problem) in enumerate(BAD_ROWS, start=2):
        assert any(f"{path}:{line}: " in report and problem in report for report in reported), (line, reported)


def test_tokenizer_without_template_is_refused(tmp_path, gpt2_files, capsys):
    vocab, merges = gpt2_files
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(CONVERSATIONS[1]) + "\n")
    code = mega(["preprocess", "--chat", "--input", str(path), "--output-prefix", str(tmp_path / "c"),
                 "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges])
    assert code == 1 and "give one with --chat-template FILE" in capsys.readouterr().err
