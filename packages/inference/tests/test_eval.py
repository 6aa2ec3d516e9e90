"""``mega eval``: WikiText perplexity over Megatron's overlapping windows equals the perplexity
transformers computes with the same windows on the same Hugging Face directory, token- and
word-level; LAMBADA accuracy equals transformers' greedy predictions, strict and not."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import hf_byte_level_directory  # noqa: E402

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from mega.inference.cli.eval import main as eval_main  # noqa: E402
from mega.inference.eval_tasks import overlapping_windows  # noqa: E402

POSITIONS = 64
TEXT = ("The quick brown fox jumps over the lazy dog . It was the best of times , it was the worst of times ; "
        "call me Ishmael . Some years ago , never mind how long precisely , having little money in my purse .")
PASSAGES = ["the cat sat on the mat and the cat", "one two three four five six seven", "hello world hello world"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("byte-gpt2")
    hf_model = hf_byte_level_directory(directory, POSITIONS)
    return directory, hf_model, transformers.AutoTokenizer.from_pretrained(directory)


def run_eval(capsys, *args) -> dict:
    assert eval_main(["--device", "cpu", *map(str, args)]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def hf_window_loss(hf_model, tokens: list[int], seq_length: int, overlap: int) -> float:
    """Megatron's windows, written out again over transformers' logits."""
    total, start, first = 0.0, 0, True
    while True:
        window = tokens[start: start + seq_length + 1]
        with torch.no_grad():
            logits = hf_model(torch.tensor([window[:-1]])).logits[0].double()
        losses = torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:]), reduction="none")
        total += losses[0 if first else seq_length - overlap:].sum().item()
        first = False
        if start + seq_length + 1 >= len(tokens):
            return total
        start += overlap


@pytest.mark.parametrize("seq_length, overlap", [(32, 8), (48, 48)])
def test_wikitext_perplexity_equals_transformers(model_dir, tmp_path, capsys, seq_length, overlap):
    directory, hf_model, tokenizer = model_dir
    data = tmp_path / "wiki.txt"
    data.write_text(TEXT)
    result = run_eval(capsys, "--load", directory, "--task", "wikitext-ppl", "--valid-data", data,
                      "--seq-length", seq_length, "--overlapping-eval", overlap, "--micro-batch-size", 3)
    tokens = tokenizer.encode(TEXT)
    loss = hf_window_loss(hf_model, tokens, seq_length, overlap) / (len(tokens) - 1)
    words = len(TEXT.split(" "))
    assert result["num_tokenized_tokens"] == len(tokens) and result["num_original_tokens"] == words
    assert result["ppl"] == pytest.approx(math.exp(loss), rel=1e-4)
    ratio = (len(tokens) - 1) / (words - 1)
    assert result["token_ratio"] == pytest.approx(ratio)
    # Word-level: the loss per word, capped at exp(20) as Megatron's is (a random model exceeds it).
    assert result["adjusted_ppl"] == pytest.approx(math.exp(min(20.0, loss * ratio)), rel=1e-4)


def test_windows_score_every_label_once():
    for length, seq_length, overlap in [(100, 32, 8), (33, 32, 32), (10, 32, 4), (97, 16, 16)]:
        windows = overlapping_windows(list(range(length)), seq_length, overlap)
        scored = [w.tokens[1 + i] for w in windows for i in range(w.scored_from, len(w.tokens) - 1)]
        assert scored == list(range(1, length)), (length, seq_length, overlap)


@pytest.mark.parametrize("strict", [False, True])
def test_lambada_accuracy_equals_transformers_greedy(model_dir, tmp_path, capsys, strict):
    directory, hf_model, tokenizer = model_dir
    data = tmp_path / "lambada.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in PASSAGES))
    args = ["--load", directory, "--task", "lambada", "--valid-data", data] + (["--strict-lambada"] if strict else [])
    args += ["--json"] if strict else []  # JSON either way; --json accepted as by every report command
    result = run_eval(capsys, *args)
    correct = 0
    for passage in PASSAGES:
        if strict:
            word = passage.split()[-1]
            context, target = tokenizer.encode(passage[: passage.rfind(word)].strip()), tokenizer.encode(" " + word)
        else:
            ids = tokenizer.encode(passage)
            context, target = ids[:-1], ids[-1:]
        tokens = context + target
        with torch.no_grad():
            logits = hf_model(torch.tensor([tokens[:-1]])).logits[0]
        correct += logits[-len(target):].argmax(-1).tolist() == target
    assert result["examples"] == len(PASSAGES) and result["correct"] == correct and result["strict"] is strict


def test_eval_refuses_bad_input(model_dir, tmp_path, capsys):
    directory = model_dir[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "no text field"}\n')
    with pytest.raises(SystemExit, match="no string field 'text'"):
        eval_main(["--load", str(directory), "--task", "lambada", "--valid-data", str(bad)])
    good = tmp_path / "wiki.txt"
    good.write_text(TEXT)
    # A flag's value the command or the model cannot take: exit 2, as `mega generate` and argparse.
    assert eval_main(["--load", str(directory), "--device", "cpu", "--task", "wikitext-ppl", "--valid-data",
                      str(good), "--seq-length", str(POSITIONS + 1)]) == 2
    assert "--seq-length 65 exceeds the model's 64 positions" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        eval_main(["--load", str(directory), "--task", "wikitext-ppl", "--valid-data", str(good), "--seq-length", "0"])
    assert stop.value.code == 2 and "mega eval: error: --seq-length must be positive, got 0" in capsys.readouterr().err
