"""From a Hub model to a fine-tuned adapter with no flag repeated (issue 53, items 2 and 3): a
Hugging Face LLaMA and Qwen3 convert to mega; `mega train --load X --finetune --sft
--packed-sequences --lora-rank 8` on a 40-conversation file with the default `--split` (its test
split empty, its validation split evaluated) needs no architecture flag; `mega generate --load X
--adapter Y` (greedy) gives the tokens transformers + PEFT give with the adapter exported by
`mega convert --to hf-peft` (fp32). CPU only, one process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import TEXT, VOCAB, save_hf_model  # noqa: E402

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from mega.core.checkpoint import read_metadata  # noqa: E402
from mega.core.cli.main import main as mega  # noqa: E402

# A chat template over plain text: the tiny BPE tokenizer has no special tokens but its end of text.
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
            "<|endoftext|>{% endgeneration %}{% else %}{{ m.content }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def qwen3_directory(directory):
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(3)
    return save_hf_model(transformers.Qwen3ForCausalLM(config).eval(), directory)


@pytest.fixture(scope="module")
def chat_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    words = " ".join(TEXT).replace(",", "").split()
    rows = [{"messages": [{"role": "user", "content": " ".join(words[i % 20: i % 20 + 3])},
                          {"role": "assistant", "content": " ".join(words[(i + 7) % 20: (i + 7) % 20 + 2])}]}
            for i in range(40)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (path.parent / "template.jinja").write_text(TEMPLATE)
    return path


def greedy_tokens_mega(load, adapter, prompt: str) -> list[int]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert mega(["generate", "--load", str(load), "--adapter", str(adapter), "--prompt", prompt, "--greedy",
                     "--max-tokens", "6", "--json", "--no-static-kv-cache"]) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])["tokens"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_hub_model_fine_tunes_with_no_architecture_flag(family, chat_jsonl, hf_dirs, tmp_path):
    hf = hf_dirs["llama-mha-untied"] if family == "llama" else qwen3_directory(tmp_path / "hf")
    base, lora, peft_dir = tmp_path / "base", tmp_path / "lora", tmp_path / "peft"
    assert mega(["convert", "--from", "hf", "--to", "mega", "--input", str(hf), "--output", str(base)]) == 0
    assert mega(["preprocess", "--chat", "--input", str(chat_jsonl), "--output-prefix", str(tmp_path / "chat"),
                 "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf), "--chat-template",
                 str(chat_jsonl.parent / "template.jinja"), "--workers", "1"]) == 0
    assert mega(["train", "--load", str(base), "--finetune", "--sft", "--packed-sequences",
                 "--calculate-per-token-loss", "--data-path", str(tmp_path / "chat_messages_document"),
                 "--seq-length", "64", "--lora-rank", "8", "--lora-alpha", "16", "--micro-batch-size", "2",
                 "--global-batch-size", "2", "--lr", "5e-2", "--train-iters", "3", "--eval-iters", "1",
                 "--log-interval", "1", "--save", str(lora)]) == 0
    saved = read_metadata(lora)
    assert saved.model_family == family
    assert {k: v for k, v in saved.model_config.items() if k != "seq_length"} == \
           {k: v for k, v in read_metadata(base).model_config.items() if k != "seq_length"}

    assert mega(["convert", "--to", "hf-peft", "--input", str(lora), "--output", str(peft_dir),
                 "--base-model", str(hf)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(model, peft_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    prompt = "user: the quick brown\nassistant: "
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
    assert greedy_tokens_mega(base, lora, prompt) == expected
    # The same through --chat (issue 53 item 4) with the adapter checkpoint alone (item 5): its base is recorded.
    messages = [{"role": "user", "content": "the quick brown"}]
    assert tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True,
                                         tokenize=False) == prompt
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert mega(["generate", "--load", str(lora), "--chat", "--chat-template", str(chat_jsonl.parent /
                     "template.jinja"), "--prompt", "the quick brown", "--greedy", "--max-tokens", "6", "--json",
                     "--no-static-kv-cache"]) == 0
    assert json.loads(out.getvalue().strip().splitlines()[-1])["tokens"] == expected
