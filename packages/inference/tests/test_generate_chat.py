"""``mega generate --chat`` (issue 53 item 4): conversations from ``--system`` + ``--prompt`` or a
JSON-lines ``--prompt-file`` (multi-line prompts included) are rendered by the checkpoint
tokenizer's chat template, or ``--chat-template FILE``, and continue with the greedy tokens
transformers gives after ``apply_chat_template(add_generation_prompt=True)``; bad lines name the
file and line. CPU only (pinned with ``--device cpu``), one process."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import BYTE_VOCAB, hf_byte_level_directory  # noqa: E402

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from mega.inference.cli.generate import main as generate_main  # noqa: E402

NEW_TOKENS = 6
OTHER_TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf-chat")
    model = hf_byte_level_directory(directory, positions=256)
    return directory, model, transformers.AutoTokenizer.from_pretrained(directory)


def expected_tokens(model, tokenizer, messages, template=None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, chat_template=template)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=BYTE_VOCAB - 1, eos_token_id=BYTE_VOCAB - 1)
    return out[0, ids.shape[1]:].tolist()


def generate_records(capsys, *args) -> list[dict]:
    assert generate_main(["--device", "cpu", "--greedy", "--max-tokens", str(NEW_TOKENS), "--json", *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_chat_from_system_and_prompt_and_from_a_jsonl_file(chat_model, capsys, tmp_path):
    directory, model, tokenizer = chat_model
    [record] = generate_records(capsys, "--load", str(directory), "--chat", "--system", "Be brief.",
                                "--prompt", "Hi there!")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    assert record["prompt"] == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert record["tokens"] == expected_tokens(model, tokenizer, messages)

    conversations = [
        [{"role": "user", "content": "Two lines:\nthe first,\nthe second."}],
        [{"role": "system", "content": "Answer."}, {"role": "user", "content": "a"},
         {"role": "assistant", "content": "b"}, {"role": "user", "content": [{"type": "text", "text": "c"}]}],
    ]
    prompt_file = tmp_path / "chats.jsonl"
    prompt_file.write_text(json.dumps({"prompt": "Two lines:\nthe first,\nthe second."}) + "\n\n"
                           + json.dumps({"messages": conversations[1]}) + "\n")
    records = generate_records(capsys, "--load", str(directory), "--chat", "--prompt-file", str(prompt_file))
    flat = [conversations[0], [*conversations[1][:3], {"role": "user", "content": "c"}]]
    assert [r["tokens"] for r in records] == [expected_tokens(model, tokenizer, m) for m in flat]

    template = tmp_path / "other.jinja"
    template.write_text(OTHER_TEMPLATE)
    [record] = generate_records(capsys, "--load", str(directory), "--chat", "--chat-template", str(template),
                                "--prompt", "Hi there!")
    assert record["prompt"] == "[USER] Hi there!\n[ASSISTANT] "
    assert record["tokens"] == expected_tokens(model, tokenizer, [{"role": "user", "content": "Hi there!"}],
                                               OTHER_TEMPLATE)


def test_a_jsonl_file_without_chat_holds_multi_line_prompts(chat_model, capsys, tmp_path):
    directory = chat_model[0]
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text(json.dumps({"prompt": "one\ntwo"}) + "\n")
    [record] = generate_records(capsys, "--load", str(directory), "--prompt-file", str(prompt_file))
    [plain] = generate_records(capsys, "--load", str(directory), "--prompt", "one\ntwo")
    assert record == plain and record["prompt"] == "one\ntwo"


@pytest.mark.parametrize("line, message", [
    ("{not json", "not a JSON object"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0]: needs a role among"),
    ('{"prompt": "a", "messages": []}', 'with "prompt" (text) or "messages"'),
    ('{"prompt": 3}', '"prompt" must be a string'),
])
def test_a_bad_line_names_the_file_and_line(chat_model, capsys, tmp_path, line, message):
    prompt_file = tmp_path / "bad.jsonl"
    prompt_file.write_text(json.dumps({"prompt": "fine"}) + "\n" + line + "\n")
    assert generate_main(["--load", str(chat_model[0]), "--device", "cpu", "--chat", "--prompt-file",
                          str(prompt_file)]) == 2
    err = capsys.readouterr().err
    assert f"{prompt_file}:2: " in err and message in err


def test_chat_flags_and_conversations_need_chat(chat_model, capsys, tmp_path, monkeypatch):
    with pytest.raises(SystemExit):
        generate_main(["--load", str(chat_model[0]), "--system", "x", "--prompt", "y"])
    assert "--system and --chat-template need --chat" in capsys.readouterr().err
    prompt_file = tmp_path / "chats.jsonl"
    prompt_file.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    assert generate_main(["--load", str(chat_model[0]), "--device", "cpu", "--prompt-file", str(prompt_file)]) == 2
    assert f"{prompt_file}:1: \"messages\" is a conversation: give --chat" in capsys.readouterr().err
    # --chat reads stdin as JSON lines too
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps({"messages": [{"role": "user", "content": "x"}]})))
    assert generate_main(["--load", str(chat_model[0]), "--device", "cpu", "--chat", "--greedy", "--max-tokens",
                          "2", "--echo"]) == 0
    assert capsys.readouterr().out.startswith("<|endoftext|><|user|>x\n<|assistant|>")
