"""A T5 checkpoint behind ``mega generate`` and ``mega serve`` (PUT /api, /v1/completions): the
greedy continuations are transformers' ``generate`` on the same weights; logprobs of generated
tokens over the OpenAI API. Tokens are ids as text (NullTokenizer: "5 17 42"), whose end of
document (the last id) is the model's end token."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import tiny_models  # noqa: E402,F401  (sets HF_HUB_OFFLINE)

transformers = pytest.importorskip("transformers")
pytest.importorskip("uvicorn")
import httpx  # noqa: E402

from mega.core.tokenizer import TokenizerOptions, TokenizerSpec  # noqa: E402
from mega.inference.cli.generate import main as generate_main  # noqa: E402

VOCAB, NEW_TOKENS = 100, 6
EOD = VOCAB - 1
PROMPTS = ["5 17 42 8 99 3", "7 20", "11 12 13 14 15 16 17 18 19"]


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    """(mega checkpoint directory, transformers model): one tiny T5 v1.0."""
    from mega.core.checkpoint import CheckpointMetadata, write_checkpoint
    from mega.models.hf_mapping import hf_to_mega
    from mega.models.t5.hf_t5 import T5_MAPPING, t5_config

    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                   dropout_rate=0.0, eos_token_id=EOD, decoder_start_token_id=0)
    torch.manual_seed(5)
    hf_model = transformers.T5ForConditionalGeneration(config).eval()
    mega_config = t5_config(config.to_dict(), seq_length=32, decoder_seq_length=16)
    directory = tmp_path_factory.mktemp("t5")
    write_checkpoint(directory, CheckpointMetadata(iteration=0, model_family="t5",
                                                   model_config=dataclasses.asdict(mega_config)),
                     hf_to_mega(T5_MAPPING, hf_model.state_dict(), mega_config),
                     tokenizer=TokenizerSpec("NullTokenizer", TokenizerOptions(vocab_size=VOCAB - 1)))
    return directory, hf_model


def hf_greedy(hf_model, prompt: str, new_tokens: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([[int(t) for t in prompt.split()]])
    row = hf_model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0, 1:].tolist()
    return row[: row.index(EOD) + 1] if EOD in row else row


def test_mega_generate_equals_transformers(t5, capsys):
    directory, hf_model = t5
    argv = ["--load", str(directory), "--greedy", "--max-tokens", str(NEW_TOKENS), "--json", "--logprobs"]
    assert generate_main(argv + [arg for prompt in PROMPTS for arg in ("--prompt", prompt)]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == PROMPTS
    for record in records:
        assert record["tokens"] == hf_greedy(hf_model, record["prompt"])
        assert len(record["logprobs"]) == len(record["tokens"]) and None not in record["logprobs"]


@pytest.fixture(scope="module")
def served(t5):
    """``mega serve`` on the T5 checkpoint, in its own process (the engine and batching it picks)."""
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(t5[0] / "serve.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "mega.core.cli.main", "serve", "--load", str(t5[0]), "--device", "cpu",
         "--port", str(port), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if process.poll() is not None:
                log.seek(0)
                pytest.fail(f"mega serve exited with {process.returncode}:\n{log.read()}")
            try:
                if httpx.get(f"{url}/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "mega serve did not answer within 300 s"
            time.sleep(0.25)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def test_server_apis_equal_transformers(served, t5):
    hf_model = t5[1]
    reply = httpx.put(f"{served}/api", json={"prompts": PROMPTS, "tokens_to_generate": NEW_TOKENS, "top_k": 1})
    assert reply.status_code == 200, reply.text
    for prompt, tokens in zip(PROMPTS, reply.json()["tokens"], strict=True):
        assert tokens == [int(t) for t in prompt.split()] + hf_greedy(hf_model, prompt)
    reply = httpx.post(f"{served}/v1/completions", json={"prompt": PROMPTS, "max_tokens": NEW_TOKENS,
                                                        "temperature": 0, "logprobs": 1})
    assert reply.status_code == 200, reply.text
    for prompt, choice in zip(PROMPTS, reply.json()["choices"], strict=True):
        generated = hf_greedy(hf_model, prompt)
        assert choice["logprobs"]["tokens"] == [str(t) for t in generated]
        assert all(value is not None and value <= 0 for value in choice["logprobs"]["token_logprobs"])
        assert choice["finish_reason"] == ("stop" if EOD in generated else "length")
    # Too long a prompt is the client's error.
    reply = httpx.post(f"{served}/v1/completions", json={"prompt": " ".join(["5"] * 40), "max_tokens": 2})
    assert reply.status_code == 400 and "positions" in reply.text
