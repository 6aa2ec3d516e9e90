"""A real ``mega serve`` process on 127.0.0.1, driven by clients we did not write: the official
``openai`` Python client (completions, streaming, n, best_of, logprobs, echo, token-id prompts,
logit_bias, models, chat) and lm-evaluation-harness's ``local-completions`` (a multiple-choice
task and a ``loglikelihood_rolling`` task over local files), every number checked against
``transformers`` on the same Hugging Face directory. The server runs the static KV cache, as it
does by default on a GPU."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import BYTE_VOCAB, hf_byte_level_directory  # noqa: E402

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
import torch  # noqa: E402

POSITIONS = 128
START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(directory, *flags: str):
    """A ``mega serve`` process on the Hugging Face ``directory`` (with ``flags``), on CPU; yields its url."""
    port = free_port()
    log = open(directory / "serve.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "mega.core.cli.main", "serve", "--load", str(directory), "--device", "cpu",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *flags],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
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
            if time.monotonic() > deadline:
                pytest.fail(f"mega serve did not answer within {START_TIMEOUT_S} s")
            time.sleep(0.25)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base url, transformers model, transformers tokenizer, model directory)."""
    directory = tmp_path_factory.mktemp("byte-gpt2")
    hf_model = hf_byte_level_directory(directory, POSITIONS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    # The path a GPU serves by default (continuous batching over the static KV cache, its decode
    # steps eager here, replayed as CUDA graphs there); the paged cache is test_server's.
    for url in serve(directory, "--static-kv-cache"):
        yield url, hf_model, tokenizer, directory


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=120)


def hf_greedy(hf_model, ids: list[int], new_tokens: int) -> list[int]:
    """Transformers' greedy continuation (ending at its end of text, as the server's does)."""
    tensor = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=BYTE_VOCAB - 1, eos_token_id=BYTE_VOCAB - 1)
    return out[0, len(ids):].tolist()


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, in float64."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def test_models_and_tokenizer_endpoints(server, client):
    url, _, tokenizer, _ = server
    [card] = client.models.list().data
    assert client.models.retrieve(card.id).id == card.id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    ids = httpx.post(f"{url}/tokenize", json={"prompt": "héllo"}).json()
    assert ids["tokens"] == tokenizer.encode("héllo") and ids["count"] == len(ids["tokens"])
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": "héllo"}
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token_id"] == tokenizer.eos_token_id == BYTE_VOCAB - 1
    assert info["max_model_len"] == POSITIONS and info["has_chat_template"] is True


def test_completions_equal_transformers(server, client):
    url, hf_model, tokenizer, _ = server
    name = client.models.list().data[0].id
    prompt = "Hello there"
    ids = tokenizer.encode(prompt)
    generated = hf_greedy(hf_model, ids, 8)
    reply = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0, logprobs=3, echo=True)
    [choice] = reply.choices
    assert choice.text == tokenizer.decode(ids + generated, skip_special_tokens=True)
    expected = hf_logprobs(hf_model, ids + generated)
    got = choice.logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids) + len(generated)
    assert torch.allclose(torch.tensor(got[1:], dtype=torch.float64), expected, atol=1e-4)
    assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs[1:])
    assert choice.logprobs.text_offset[:3] == [0, 1, 2]  # one byte (character here) per token
    # Token-id prompts, several in one request.
    prompts = [ids, tokenizer.encode("The cat")]
    reply = client.completions.create(model=name, prompt=prompts, max_tokens=5, temperature=0)
    for choice, prompt_ids in zip(sorted(reply.choices, key=lambda c: c.index), prompts, strict=True):
        assert choice.text == tokenizer.decode(hf_greedy(hf_model, prompt_ids, 5), skip_special_tokens=True)
    assert reply.usage.prompt_tokens == sum(map(len, prompts))


def test_sampling_options(server, client):
    name = client.models.list().data[0].id
    z = server[2].encode("z")[0]
    biased = client.completions.create(model=name, prompt="abc", max_tokens=6, temperature=0,
                                       logit_bias={str(z): 100})
    assert biased.choices[0].text == "z" * 6
    # A penalty on what was generated: the biased token cannot repeat forever.
    penalised = client.completions.create(model=name, prompt="abc", max_tokens=6, temperature=0,
                                          logit_bias={str(z): 5}, frequency_penalty=2.0)
    assert penalised.choices[0].text != "z" * 6
    two = client.completions.create(model=name, prompt="abc", max_tokens=6, n=2, seed=7, temperature=1.0)
    again = client.completions.create(model=name, prompt="abc", max_tokens=6, n=2, seed=7, temperature=1.0)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [c.text for c in again.choices]
    best = client.completions.create(model=name, prompt="abc", max_tokens=6, n=1, best_of=3, seed=7)
    assert len(best.choices) == 1
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=name, prompt="abc", n=2, best_of=1)


def test_streaming_with_usage_and_logprobs(server, client):
    name = client.models.list().data[0].id
    whole = client.completions.create(model=name, prompt="Once upon", max_tokens=10, temperature=0, logprobs=2)
    chunks = list(client.completions.create(model=name, prompt="Once upon", max_tokens=10, temperature=0, logprobs=2,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    pieces = [c.choices[0] for c in chunks[:-1]]
    assert "".join(p.text for p in pieces) == whole.choices[0].text
    streamed = [(t, v, o) for p in pieces if p.logprobs for t, v, o in
                zip(p.logprobs.tokens, p.logprobs.token_logprobs, p.logprobs.text_offset, strict=True)]
    expected = whole.choices[0].logprobs
    assert [t for t, _, _ in streamed] == expected.tokens
    assert [o for _, _, o in streamed] == expected.text_offset
    assert [v for _, v, _ in streamed] == pytest.approx(expected.token_logprobs)
    tops = [top for p in pieces if p.logprobs for top in p.logprobs.top_logprobs]
    assert tops == expected.top_logprobs


def test_stop_strings_trim_text_and_logprobs(server, client):
    name = client.models.list().data[0].id
    whole = client.completions.create(model=name, prompt="Once upon", max_tokens=10, temperature=0, logprobs=0)
    text = whole.choices[0].text
    stop = text[4:6]
    cut = client.completions.create(model=name, prompt="Once upon", max_tokens=10, temperature=0, logprobs=0,
                                    stop=[stop])
    choice = cut.choices[0]
    assert choice.text == text[: text.index(stop)] and choice.finish_reason == "stop"
    assert "".join(choice.logprobs.tokens) == choice.text
    streamed = list(client.completions.create(model=name, prompt="Once upon", max_tokens=10, temperature=0,
                                              logprobs=0, stop=[stop], stream=True))
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert "".join(tokens) == choice.text


def test_chat_completions_with_the_tokenizers_template(server, client):
    _, hf_model, tokenizer, _ = server
    name = client.models.list().data[0].id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = tokenizer.decode(hf_greedy(hf_model, ids, 8), skip_special_tokens=True)
    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0)
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sixteen_concurrent_requests_with_one_bad_seed(server):
    url = server[0]

    async def run():
        async_client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        name = (await async_client.models.list()).data[0].id

        async def one(i: int):
            seed = 2**64 if i == 5 else i
            try:
                reply = await async_client.completions.create(model=name, prompt=f"request {i}", max_tokens=8, seed=seed)
                return 200, reply
            except openai.APIStatusError as error:
                return error.status_code, error

        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await async_client.close()

    answers = asyncio.run(run())
    statuses = [status for status, _ in answers]
    assert statuses.count(200) == 15 and statuses[5] == 400, statuses
    assert answers[5][1].body["param"] == "seed"
    assert all(len(reply.choices) == 1 for status, reply in answers if status == 200)


def test_every_v1_error_is_an_openai_error_object(server):
    url = server[0]
    cases = [
        httpx.get(f"{url}/v1/no-such-route"),
        httpx.get(f"{url}/v1/completions"),
        httpx.post(f"{url}/v1/completions", json={"prompt": "x" * (5 << 20)}),
        httpx.post(f"{url}/v1/completions", json={"prompt": "abc", "temprature": 0}),
        httpx.post(f"{url}/v1/completions", content=b'{"prompt": "\\ud800 lone surrogate"}',
                   headers={"content-type": "application/json"}),
        httpx.post(f"{url}/v1/completions", json={"prompt": [[1, 2], [BYTE_VOCAB + 5]]}),
        httpx.post(f"{url}/v1/completions", json={"prompt": "abc", "suffix": "def"}),
    ]
    assert [reply.status_code for reply in cases] == [404, 405, 413, 400, 400, 400, 400]
    for reply in cases:
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert cases[3].json()["error"]["param"] == "temprature"
    assert cases[4].json()["error"]["param"] == "prompt" and "Unicode" in cases[4].json()["error"]["message"]
    assert "outside the vocabulary" in cases[5].json()["error"]["message"]
    assert httpx.get(f"{url}/v1/health").status_code == 200


# --- lm-evaluation-harness ------------------------------------------------------------------

MC_DOCS = [{"question": "The colour of the sky is", "choices": ["blue", "green", "made of cheese"], "answer": 0},
           {"question": "Two plus two is", "choices": ["four", "five"], "answer": 1},
           {"question": "Cats say", "choices": ["meow", "woof", "moo", "hello there"], "answer": 2}]
ROLLING_DOCS = [{"text": "It was the best of times, it was the worst of times."},
                {"text": "A short one."},
                {"text": "Call me Ishmael. Some years ago, never mind how long precisely."}]
MAX_LENGTH = POSITIONS - 1  # lm-eval asks for one token past each window


def write_tasks(directory) -> None:
    (directory / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (directory / "rolling.jsonl").write_text("".join(json.dumps(d) + "\n" for d in ROLLING_DOCS))
    (directory / "mega_mc.yaml").write_text(
        "task: mega_tiny_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {directory / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (directory / "mega_rolling.yaml").write_text(
        "task: mega_tiny_rolling\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {directory / 'rolling.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n")


def test_lm_evaluation_harness_local_completions(server, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    url, hf_model, tokenizer, directory = server
    write_tasks(tmp_path)
    name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": name, "base_url": f"{url}/v1/completions", "tokenizer_backend": "huggingface",
                    "tokenizer": str(directory), "tokenized_requests": True, "max_length": MAX_LENGTH,
                    "num_concurrent": 1, "max_retries": 1},
        tasks=["mega_tiny_mc", "mega_tiny_rolling"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, batch_size=4)
    eot = tokenizer.eos_token_id
    # Multiple choice: log p(" " + choice | question) (lm-eval's target delimiter is a space);
    # byte tokens, so context and continuation tokenize apart.
    mc = sorted(results["samples"]["mega_tiny_mc"], key=lambda s: s["doc_id"])
    for sample, doc in zip(mc, MC_DOCS, strict=True):
        context = tokenizer.encode(doc["question"])
        for (loglikelihood, _), choice in zip([r[0] for r in sample["resps"]], doc["choices"], strict=True):
            continuation = tokenizer.encode(" " + choice)
            expected = hf_logprobs(hf_model, context + continuation)[len(context) - 1:].sum().item()
            assert loglikelihood == pytest.approx(expected, abs=1e-4)
    # Rolling: each document (shorter than a window) after the end-of-text token.
    rolling = sorted(results["samples"]["mega_tiny_rolling"], key=lambda s: s["doc_id"])
    for sample, doc in zip(rolling, ROLLING_DOCS, strict=True):
        expected = hf_logprobs(hf_model, [eot] + tokenizer.encode(doc["text"])).sum().item()
        assert sample["resps"][0][0] == pytest.approx(expected, abs=1e-4)
