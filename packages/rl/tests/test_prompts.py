"""--prompt-data: reading JSON Lines prompts (text and chat messages), errors that name the file
and line, and the seeded iterator's exact resume. CPU only (no tensors)."""

from __future__ import annotations

import json

import pytest

from mega.data.chat_template import ChatTemplate
from mega.rl.prompts import PromptDataError, PromptIterator, prompt_chat_template, read_prompt_data

# A ChatML template as Hugging Face tokenizers ship it.
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_lines(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_prompts_and_messages_with_their_fields(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [
        {"prompt": "What is 2+2?", "answer": "4"},
        "",
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4?"}],
         "answer": "7", "format_regex": "boxed"},
    ])
    prompts = read_prompt_data(path, ChatTemplate(CHATML))
    assert [p.text for p in prompts] == [
        "What is 2+2?",
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n3+4?<|im_end|>\n<|im_start|>assistant\n"]
    assert prompts[0].fields == {"answer": "4"}
    assert prompts[1].fields["answer"] == "7" and prompts[1].fields["format_regex"] == "boxed"
    assert prompts[1].where == f"{path}:3"


def test_the_chat_template_is_rendered_as_transformers_renders_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, "<unk>")),
                                                     unk_token="<unk>")
    tokenizer.chat_template = CHATML
    messages = [{"role": "user", "content": "Name a prime."}]
    path = write_lines(tmp_path / "p.jsonl", [{"messages": messages}])
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert read_prompt_data(path, ChatTemplate(CHATML))[0].text == expected


def test_the_chat_template_comes_from_the_flag_or_beside_the_tokenizer(tmp_path):
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<eos>"}))
    (tmp_path / "plain.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}=")
    messages = [{"role": "user", "content": "hi"}]
    assert prompt_chat_template(None, str(tokenizer_dir)).render(messages, add_generation_prompt=True)[0] == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_chat_template(str(tmp_path / "plain.jinja"), str(tokenizer_dir)).render(messages)[0] == "hi="
    assert prompt_chat_template(None, str(tmp_path)) is None
    with pytest.raises(PromptDataError, match="--chat-template .*missing.jinja"):
        prompt_chat_template(str(tmp_path / "missing.jinja"), None)


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "a"', "not valid JSON"),
    ('["a"]', "must be a JSON object, got list"),
    ('{"answer": 1}', "exactly one of `prompt`.*neither"),
    ('{"prompt": "a", "messages": []}', "exactly one of `prompt`.*both"),
    ('{"prompt": 3}', "`prompt` must be a non-empty string"),
    ('{"messages": [{"role": "user"}]}', "message 1 must be an object with string `role` and `content`"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "needs a chat template"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "fine"}', line])
    with pytest.raises(PromptDataError, match=f"^{tmp_path / 'bad.jsonl'}:2: .*{message}"):
        read_prompt_data(path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(PromptDataError, match="no such file"):
        read_prompt_data(tmp_path / "missing.jsonl")
    with pytest.raises(PromptDataError, match="holds no prompt"):
        read_prompt_data(write_lines(tmp_path / "empty.jsonl", [""]))


def _prompts(tmp_path, count=7):
    return read_prompt_data(write_lines(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(count)]))


def test_iterator_visits_every_prompt_once_per_epoch_in_a_seeded_order(tmp_path):
    prompts = _prompts(tmp_path)
    first = [p.text for p in PromptIterator(prompts, seed=3).next_batch(14)]
    assert sorted(first[:7]) == sorted(first[7:]) == sorted(p.text for p in prompts)
    assert first[:7] != first[7:]                                    # a new order each epoch
    assert first == [p.text for p in PromptIterator(prompts, seed=3).next_batch(14)]
    assert first != [p.text for p in PromptIterator(prompts, seed=4).next_batch(14)]
    assert [p.text for p in PromptIterator(prompts, seed=3, shuffle=False).next_batch(3)] == ["q0", "q1", "q2"]


def test_iterator_resumes_exactly(tmp_path):
    prompts = _prompts(tmp_path)
    straight = PromptIterator(prompts, seed=11)
    batches = [[p.text for p in straight.next_batch(3)] for _ in range(6)]  # crosses two epoch ends

    stopped = PromptIterator(prompts, seed=11)
    for _ in range(3):
        stopped.next_batch(3)
    state = json.loads(json.dumps(stopped.state_dict()))  # it travels in a checkpoint as plain data
    resumed = PromptIterator(prompts, seed=11)
    resumed.load_state_dict(state)
    assert [[p.text for p in resumed.next_batch(3)] for _ in range(3)] == batches[3:]

    with pytest.raises(ValueError, match="seed 11.*seed 12"):
        PromptIterator(prompts, seed=12).load_state_dict(state)
    with pytest.raises(ValueError, match="for 7 prompts, the prompt data now has 6"):
        PromptIterator(prompts[:6], seed=11).load_state_dict(state)
