"""The REST server over a real socket: Megatron's PUT /api, OpenAI-style completions (streamed
too), validation, 64 concurrent clients, a client leaving mid-stream; one server per module."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import sys
import threading
import time

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import POSITIONS, VOCAB, hf_tiny, mega_from_hf  # noqa: E402

pytest.importorskip("transformers")
uvicorn = pytest.importorskip("uvicorn")

from mega.core.plugins import get_plugins  # noqa: E402
from mega.core.tokenizer import TokenizerOptions  # noqa: E402
from mega.inference.engine import GenerationEngine, GenerationRequest  # noqa: E402
from mega.inference.engine.continuous import ContinuousBatchingWorker  # noqa: E402
from mega.inference.engine.stopping import StopRules  # noqa: E402
from mega.inference.http.server import MAX_BODY_BYTES, create_app  # noqa: E402
from mega.inference.http.service import InferenceService  # noqa: E402

API_KEY = "secret-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    """(base url, service): a tiny GPT-2 with ids-as-text tokens (NullTokenizer: "5 17 42")."""
    model, config = mega_from_hf(hf_tiny("gpt2"), "gpt")
    tokenizer = get_plugins().tokenizers.get("NullTokenizer")(TokenizerOptions(vocab_size=VOCAB - 1))
    assert tokenizer.vocab_size == VOCAB and tokenizer.eod == VOCAB - 1
    engine = GenerationEngine(model, vocab_size=VOCAB, max_positions=POSITIONS, tokenizer=tokenizer)
    worker = ContinuousBatchingWorker(engine, max_batch_size=32)
    service = InferenceService(engine, worker, tokenizer, "tiny-gpt2")
    worker.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", service
    server.should_exit = True
    thread.join()
    worker.stop()


def expected_greedy(service, prompt: str, new_tokens: int) -> list[int]:
    request = GenerationRequest(service.tokenize(prompt, "prompt"), new_tokens,
                                stop=StopRules(stop_ids=frozenset({service.tokenizer.eod})))
    return service.engine.generate([request])[0].tokens


def test_health_and_schema(served):
    url, _ = served
    assert httpx.get(f"{url}/v1/health").json() == {"status": "ok", "model": "tiny-gpt2"}
    schema = httpx.get(f"{url}/openapi.json").json()
    assert {"/api", "/v1/completions", "/v1/health"} <= set(schema["paths"])
    assert "prompts" in schema["components"]["schemas"]["MegatronRequest"]["properties"]
    assert httpx.get(f"{url}/docs").status_code == 200


def test_megatron_api_greedy_with_logprobs(served):
    url, service = served
    prompts = ["5 17 42 8", "7 200"]
    reply = httpx.put(f"{url}/api", json={"prompts": prompts, "tokens_to_generate": 6, "top_k": 1, "logprobs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert set(body) == {"text", "segments", "logprobs", "tokens"}
    for i, prompt in enumerate(prompts):
        tokens = expected_greedy(service, prompt, 6)
        assert body["tokens"][i] == tokens
        assert body["text"][i] == " ".join(map(str, tokens))
        assert body["segments"][i] == [str(t) for t in tokens]
        assert len(body["logprobs"][i]) == len(tokens) - 1
    # Defaults: sampled, 64 tokens, no logprobs; a seed reproduces.
    seeded = {"prompts": ["3 4"], "random_seed": 5, "tokens_to_generate": 10}
    first, second = (httpx.put(f"{url}/api", json=seeded).json() for _ in range(2))
    assert first["tokens"] == second["tokens"] and first["logprobs"] is None


@pytest.mark.parametrize("body, status, words", [
    ({}, 400, "prompts"),
    ({"prompts": "5 6"}, 400, "prompts"),
    ({"prompts": []}, 400, "prompts"),
    ({"prompts": ["5"] * 129}, 400, "prompts"),
    ({"prompts": ["5"], "temperature": 0}, 400, "temperature"),
    ({"prompts": ["5"], "temperature": 101}, 400, "temperature"),
    ({"prompts": ["5"], "top_k": 1001}, 400, "top_k"),
    ({"prompts": ["5"], "top_k": 5, "top_p": 0.5}, 400, "top_k and top_p"),
    ({"prompts": ["5"], "top_p": 1.5}, 400, "top_p"),
    ({"prompts": ["5"], "tokens_to_generate": 0}, 400, "tokens_to_generate"),
    ({"prompts": ["5"], "tokens_to_generate": -1}, 400, "tokens_to_generate"),
    ({"prompts": ["5"], "logprobs": "yes"}, 400, "logprobs"),
    ({"prompts": ["5"], "random_seed": -1}, 400, "random_seed"),
    ({"prompts": [""]}, 400, "add_BOS"),
    ({"prompts": ["5"], "max_len": 10}, 400, "tokens_to_generate"),
    ({"prompts": ["5"], "sentences": ["5"]}, 400, "prompts"),
    ({"prompts": ["5"], "beam_width": 2}, 400, "beam"),
    ({"prompts": ["5 6"], "tokens_to_generate": POSITIONS}, 400, "positions"),
    ({"prompts": ["5 x"]}, 400, "integers"),
])
def test_megatron_api_refuses_invalid_requests(served, body, status, words):
    url, _ = served
    reply = httpx.put(f"{url}/api", json=body)
    assert reply.status_code == status
    assert words in reply.json(), reply.json()


def test_invalid_json_and_oversized_bodies_are_refused(served):
    url, _ = served
    reply = httpx.put(f"{url}/api", content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "JSON" in reply.json()
    huge = {"prompts": ["5 " * 2_500_000]}  # 5 MB
    assert httpx.put(f"{url}/api", json=huge).status_code == 413
    assert httpx.get(f"{url}/v1/health").status_code == 200  # still serving


def test_completions_greedy_echo_logprobs_and_stop(served):
    url, service = served
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": ["5 17 42", "9 9"], "max_tokens": 5,
                                                     "temperature": 0, "logprobs": 2, "echo": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny-gpt2" and body["id"].startswith("cmpl-")
    for i, prompt in enumerate(["5 17 42", "9 9"]):
        tokens = expected_greedy(service, prompt, 5)
        choice = body["choices"][i]
        assert choice["index"] == i and choice["finish_reason"] == "length"
        generated = " ".join(map(str, tokens[len(prompt.split()):]))
        assert choice["text"] == prompt + generated  # NullTokenizer text: ids joined by spaces
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [str(t) for t in tokens] and logprobs["token_logprobs"][0] is None
        assert len(logprobs["top_logprobs"]) == len(tokens) and len(logprobs["top_logprobs"][1]) == 2
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15}
    # A stop string: the text ends before it, the finish reason is "stop".
    tokens = expected_greedy(service, "5 17 42", 8)
    stop = f" {tokens[6]}"
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": "5 17 42", "max_tokens": 8, "temperature": 0,
                                                     "stop": stop}).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == " ".join(map(str, tokens[3:])).split(stop)[0]


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": "5", "n": 0}, "n"),
    ({"prompt": "5", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "5", "seed": 2**64}, "seed"),
    ({"prompt": "5", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "5", "logit_bias": {"3": 101}}, "logit_bias"),
    ({"prompt": "5", "logit_bias": {"300": 1}}, "logit_bias"),
    ({"prompt": "5", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "5", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "5", "max_tokne": 3}, "max_tokne"),
    ({"prompt": [5, -1]}, "prompt"),
    ({"prompt": [[5], []]}, "prompt"),
    ({"prompt": "5", "temperature": -1}, "temperature"),
    ({"prompt": "5", "top_p": 0}, "top_p"),
    ({"prompt": "5", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "5", "logprobs": 21}, "logprobs"),
    ({"prompt": "5", "max_tokens": POSITIONS}, "prompt"),
    ({"prompt": "5", "stream": "yes"}, "stream"),
])
def test_completions_refuse_invalid_requests(served, body, param):
    url, _ = served
    reply = httpx.post(f"{url}/v1/completions", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param in error["message"]


def stream_events(url: str, body: dict) -> list:
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    return events


def test_streaming_sends_what_the_whole_completion_holds(served):
    url, _ = served
    body = {"prompt": ["5 17 42", "7"], "max_tokens": 6, "temperature": 0}
    whole = httpx.post(f"{url}/v1/completions", json=body).json()["choices"]
    events = stream_events(url, body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    for choice in whole:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1]) and len(mine) > 2


def test_sixty_four_concurrent_clients_are_batched_and_answered_correctly(served):
    url, service = served
    prompts = [" ".join(str((7 * i + j) % (VOCAB - 1)) for j in range(1 + i % 9)) for i in range(64)]
    new_tokens = [2 + i % 7 for i in range(64)]
    expected = [expected_greedy(service, p, n) for p, n in zip(prompts, new_tokens, strict=True)]
    batches_before = service.worker.batches_run

    async def clients():
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            async def one(i):
                if i % 2:
                    reply = await client.put("/api", json={"prompts": [prompts[i]], "tokens_to_generate": new_tokens[i],
                                                           "top_k": 1})
                    return reply.json()["tokens"][0]
                reply = await client.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": new_tokens[i],
                                                                    "temperature": 0})
                return prompts[i].split() + reply.json()["choices"][0]["text"].split()
            return await asyncio.gather(*(one(i) for i in range(64)))

    answers = asyncio.run(clients())
    for i, answer in enumerate(answers):
        tokens = [int(t) for t in answer]
        assert tokens == [t for t in expected[i] if t != service.tokenizer.eod], i
    assert service.worker.batches_run - batches_before < 64 / 2  # gathered, not one by one


def test_a_client_leaving_mid_stream_does_not_hurt_the_others(served, monkeypatch):
    url, service = served
    expected = expected_greedy(service, "3 1 4 1 5", 40)
    finish_reasons = {}
    worker = service.worker  # the one loop: its decode step hands out tokens and endings
    on_token, finish = worker._decode_step.on_token, worker._finish

    def slow_on_token(*args):  # 10 ms a token: the client surely leaves before the end
        time.sleep(0.01)
        on_token(*args)

    def recording_finish(sequence):
        finish_reasons[tuple(sequence.request.prompt)] = sequence.finish_reason
        finish(sequence)

    monkeypatch.setattr(worker._decode_step, "on_token", slow_on_token)
    monkeypatch.setattr(worker._decode_step, "on_finish", recording_finish)
    monkeypatch.setattr(worker, "_finish", recording_finish)
    other = {}

    def other_client():
        other["reply"] = httpx.put(f"{url}/api", json={"prompts": ["3 1 4 1 5"], "tokens_to_generate": 40, "top_k": 1})

    with httpx.stream("POST", f"{url}/v1/completions",
                      json={"prompt": "2 7 1 8", "max_tokens": 50, "temperature": 0, "stream": True}) as reply:
        assert next(reply.iter_lines()).startswith("data: ")
        beside = threading.Thread(target=other_client)
        beside.start()
    # The stream is closed after its first event, while the other request waits or runs.
    beside.join()
    assert other["reply"].status_code == 200 and other["reply"].json()["tokens"][0] == expected
    again = httpx.put(f"{url}/api", json={"prompts": ["3 1 4 1 5"], "tokens_to_generate": 40, "top_k": 1})
    assert again.json()["tokens"][0] == expected
    assert finish_reasons[(2, 7, 1, 8)] == "cancelled"  # the engine stopped generating for it


def test_api_key_guards_every_route_but_health(served):
    """Without the key (or with a wrong one): 401 with OpenAI's error object on every route, the
    metrics and the schema included; the health checks stay open; the official ``openai`` client
    with ``api_key=`` gets through, and with a wrong key raises its AuthenticationError."""
    import openai

    _, service = served
    app = create_app(service, api_key=API_KEY)
    auth = {"Authorization": f"Bearer {API_KEY}"}

    async def calls():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            refused = [await client.put("/api", json={"prompts": ["5"], "tokens_to_generate": 2}),
                       await client.post("/v1/completions", json={"prompt": "5"}, headers={"Authorization": "Bearer no"}),
                       await client.get("/metrics"), await client.get("/openapi.json"),
                       await client.post("/v1/completions", content=b"x" * (MAX_BODY_BYTES + 1))]
            allowed = [await client.put("/api", json={"prompts": ["5"], "tokens_to_generate": 2}, headers=auth),
                       await client.get("/metrics", headers=auth), await client.get("/health"),
                       await client.get("/v1/health")]
            results = []
            for key in (API_KEY, "wrong"):
                openai_client = openai.AsyncOpenAI(api_key=key, base_url="http://test/v1", max_retries=0,
                                                   http_client=httpx.AsyncClient(transport=transport))
                try:
                    results.append(await openai_client.completions.create(model="tiny-gpt2", prompt="5 17", max_tokens=3,
                                                                          temperature=0))
                except openai.AuthenticationError as error:
                    results.append(error)
            return refused, allowed, results

    refused, allowed, (completion, error) = asyncio.run(calls())
    for response in refused:  # an oversized body without the key: 401 before anything is read
        assert response.status_code == 401, response.request.url
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert all(response.status_code == 200 for response in allowed)
    assert completion.choices[0].text and isinstance(error, openai.AuthenticationError)


def test_requests_past_the_timeout_get_408_and_leave_the_batch(served):
    _, service = served
    app = create_app(dataclasses.replace(service, request_timeout=0.001))

    async def call():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", json={"prompt": "5 17", "max_tokens": 40, "temperature": 0})

    response = asyncio.run(call())
    assert response.status_code == 408 and "--request-timeout" in response.json()["error"]["message"]


def test_chat_without_a_template_is_a_clear_400(served):
    url, _ = served
    reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "5 6"}]})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages" and "chat template" in error["message"]


def test_a_failing_engine_is_a_500_error_object_and_the_server_lives_on(served, monkeypatch):
    url, service = served

    def broken(*args, **kwargs):  # every forward of the loop's step
        raise RuntimeError("the accelerator caught fire")

    monkeypatch.setattr(service.engine, "forward", broken)
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": "5 6", "max_tokens": 2})
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert error["type"] == "server_error" and "caught fire" in error["message"]
    monkeypatch.undo()
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "5 6", "max_tokens": 2}).status_code == 200


def test_metrics_are_prometheus_text(served):
    url, _ = served
    httpx.post(f"{url}/v1/completions", json={"prompt": "5 6", "max_tokens": 2})
    httpx.get(f"{url}/v1/no-such-route")
    reply = httpx.get(f"{url}/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    values = {}
    for line in reply.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['mega_requests_total{route="/v1/completions",status="200"}'] >= 1
    assert values['mega_requests_total{route="other",status="404"}'] >= 1
    assert values["mega_queue_time_seconds_count"] >= 1 and values["mega_batch_occupancy_count"] >= 1
    assert values['mega_batch_occupancy_bucket{le="+Inf"}'] == values["mega_batch_occupancy_count"]
    assert values["mega_generated_tokens_total"] >= 2


def test_tokenizing_runs_off_the_event_loop(served, monkeypatch):
    """While a (huge, here: held) prompt is being tokenized, the server still answers."""
    url, service = served
    entered, release = threading.Event(), threading.Event()
    original = service.tokenizer.tokenize

    def held(text):
        entered.set()
        release.wait(timeout=30)
        return original(text)

    monkeypatch.setattr(service.tokenizer, "tokenize", held)
    result = {}
    sender = threading.Thread(target=lambda: result.update(
        reply=httpx.post(f"{url}/v1/completions", json={"prompt": "5 6", "max_tokens": 2}, timeout=60)))
    sender.start()
    try:
        assert entered.wait(timeout=30)
        health = httpx.get(f"{url}/v1/health", timeout=10)  # the event loop is free
    finally:
        release.set()
        sender.join()
    assert health.status_code == 200 and result["reply"].status_code == 200


def test_max_model_len_caps_requests_and_sizes_the_cache(served):
    """CPU. ``--max-model-len 24`` (engine.cap_length, as ``mega serve`` applies it): prompt +
    max_tokens over it is a 400 naming the prompt and the flag, on both APIs; within it the
    completion equals the uncapped engine's; a null max_tokens fills up to it; the static cache's
    slots and the paged cache's default size follow it."""
    from mega.inference.engine.continuous import ContinuousBatchingWorker

    _, service = served
    engine = GenerationEngine(service.engine.model, vocab_size=VOCAB, max_positions=POSITIONS,
                              tokenizer=service.tokenizer)
    engine.cap_length(24)
    worker = ContinuousBatchingWorker(engine, max_batch_size=2, static_cache=True)
    assert worker.cache.max_length == 24
    assert ContinuousBatchingWorker(engine, max_batch_size=2).max_num_tokens == 2 * 24
    capped = InferenceService(engine, worker, service.tokenizer, "tiny-gpt2")
    app = create_app(capped)

    async def calls():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.post("/v1/completions", json={"prompt": "5 17 42", "max_tokens": 22}),
                    await client.put("/api", json={"prompts": ["5 17 42"], "tokens_to_generate": 22}),
                    await client.post("/v1/completions", json={"prompt": "5 17 42", "max_tokens": 21,
                                                               "temperature": 0}),
                    await client.post("/v1/completions", json={"prompt": "5 17 42", "max_tokens": None,
                                                               "temperature": 0}),
                    await client.get("/tokenizer_info")]

    worker.start()
    try:
        too_long, megatron_too_long, fits, unbounded, info = asyncio.run(calls())
    finally:
        worker.stop()
    assert too_long.status_code == 400 and megatron_too_long.status_code == 400
    error = too_long.json()["error"]
    assert error["param"] == "prompt" and "= 25 exceeds --max-model-len 24" in error["message"], error
    assert "--max-model-len 24" in megatron_too_long.text
    assert fits.status_code == 200 and unbounded.status_code == 200
    expected = service.engine.generate([GenerationRequest([5, 17, 42], 21)])[0].generated
    assert fits.json()["choices"][0]["text"] == " ".join(map(str, expected))
    assert unbounded.json()["usage"]["completion_tokens"] <= 21 and info.json()["max_model_len"] == 24
