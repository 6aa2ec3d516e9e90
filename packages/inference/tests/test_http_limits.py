"""The HTTP layer's guards and limits over a real socket (uvicorn on 127.0.0.1; CPU, a tiny
GPT-2 with ids-as-text tokens): the API key before the body on every route (the schema pages
too) with the scheme in any case, an empty key refused at start, OpenAI error objects for 404
and 405, ``HEAD /health``, ``logit_bias`` keys, the prompt-list limits named, a prompt too long
for ``--max-model-len`` refused before it is tokenized while ``/health`` stays fast, the bounded
waiting queue (429 with Retry-After), a non-streaming request cancelled when its client goes,
and the running/queued gauges on an idle server."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time

import httpx
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import POSITIONS, VOCAB, hf_byte_level_directory, hf_tiny, mega_from_hf  # noqa: E402

pytest.importorskip("transformers")
uvicorn = pytest.importorskip("uvicorn")

from mega.core.plugins import get_plugins  # noqa: E402
from mega.core.tokenizer import TokenizerOptions  # noqa: E402
from mega.inference.engine import GenerationEngine  # noqa: E402
from mega.inference.engine.continuous import ContinuousBatchingWorker  # noqa: E402
from mega.inference.http.app import create_base_app  # noqa: E402
from mega.inference.http.server import create_app  # noqa: E402
from mega.inference.http.service import InferenceService  # noqa: E402

API_KEY = "secret-key"
DEVICE = torch.device("cpu")  # pinned: the same on a GPU machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(app):
    """``app`` under uvicorn on a free loopback port, in a thread; yields its base url."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()


@pytest.fixture(scope="module")
def parts():
    """(engine, tokenizer): a tiny GPT-2 and the NullTokenizer ("5 17 42" is three tokens)."""
    model, _ = mega_from_hf(hf_tiny("gpt2"), "gpt")
    tokenizer = get_plugins().tokenizers.get("NullTokenizer")(TokenizerOptions(vocab_size=VOCAB - 1))
    engine = GenerationEngine(model.to(DEVICE), vocab_size=VOCAB, max_positions=POSITIONS, tokenizer=tokenizer)
    return engine, tokenizer


@contextlib.contextmanager
def server(parts, **settings):
    """A whole server (its own worker and service): yields (url, service)."""
    engine, tokenizer = parts
    app_settings = {key: settings.pop(key) for key in ("api_key", "max_body_bytes") if key in settings}
    worker = ContinuousBatchingWorker(engine, max_batch_size=8)
    service = InferenceService(engine, worker, tokenizer, "tiny-gpt2", **settings)
    worker.start()
    try:
        with serving(create_app(service, **app_settings)) as url:
            yield url, service
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def plain(parts):
    with server(parts) as served:
        yield served


def held_engine(monkeypatch, engine):
    """The engine's forwards wait for the returned event before they run: the one loop stays on its
    first step, and requests stay in flight."""
    release = threading.Event()
    forward = engine.forward

    def held(*args, **kwargs):
        release.wait(timeout=60)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine, "forward", held)
    return release


def test_the_key_is_checked_before_the_body_on_every_route_in_any_scheme_case(parts):
    with server(parts, api_key=API_KEY) as (url, _):
        for path in ("/docs", "/openapi.json", "/redoc", "/metrics", "/v1/models", "/v1/models/x", "/v1/completions"):
            reply = httpx.get(f"{url}{path}")
            assert reply.status_code == 401, path
            assert reply.json()["error"]["code"] == "invalid_api_key" and reply.headers["www-authenticate"] == "Bearer"
        # Malformed JSON without the key: 401, not 400 (the body is never read).
        reply = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert reply.status_code == 401
        for scheme in ("Bearer", "bearer", "BEARER"):
            reply = httpx.post(f"{url}/v1/completions", json={"prompt": "5 6", "max_tokens": 2, "temperature": 0},
                               headers={"Authorization": f"{scheme} {API_KEY}"})
            assert reply.status_code == 200, scheme
        assert httpx.get(f"{url}/docs", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200  # open: what load balancers probe
        assert httpx.get(f"{url}/no-such-route").status_code == 404  # no route: nothing to guard


def test_an_empty_api_key_is_refused_at_start(monkeypatch, tmp_path):
    from mega.inference.cli.serve import main

    with pytest.raises(SystemExit, match="API key .*is empty"):
        main(["--load", str(tmp_path), "--api-key", ""])
    monkeypatch.setenv("MEGA_API_KEY", "")
    with pytest.raises(SystemExit, match="API key .*is empty"):
        main(["--load", str(tmp_path)])
    with pytest.raises(ValueError, match="must not be empty"):
        create_base_app("t", "d", "m", [], api_key="")


def test_unknown_routes_and_methods_are_openai_errors_and_head_health_works(plain):
    url, _ = plain
    for reply, status in ((httpx.get(f"{url}/no-such-route"), 404), (httpx.get(f"{url}/v1/nothing"), 404),
                          (httpx.get(f"{url}/v1/completions"), 405), (httpx.post(f"{url}/health"), 405)):
        assert reply.status_code == status
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}, reply.text
    assert httpx.head(f"{url}/health").status_code == 200 and httpx.head(f"{url}/v1/health").status_code == 200


@pytest.mark.parametrize("route, extra", [("/v1/completions", {"prompt": "5"}),
                                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "5"}]})])
@pytest.mark.parametrize("key", ["²", "٣", "9" * 5000, "-1", " 3"])
def test_logit_bias_keys_must_be_ascii_token_ids(plain, route, extra, key):
    url, _ = plain
    reply = httpx.post(f"{url}{route}", json={**extra, "logit_bias": {key: 1}})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "logit_bias" and "token ids" in error["message"]


@pytest.mark.parametrize("prompt, words", [(["5"] * 129, "129 prompts, more than the 128"),
                                           ([], "must not be empty"),
                                           ([[]], "prompt[0]: an empty list of token ids"),
                                           ([[5], []], "prompt[1]: an empty list of token ids")])
def test_prompt_list_limits_are_named(plain, prompt, words):
    url, _ = plain
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": prompt})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "prompt" and words in error["message"], error


def test_a_prompt_too_long_for_the_model_is_refused_untokenized_and_health_stays_fast(plain, monkeypatch):
    url, service = plain
    seen = []
    tokenize = service.tokenizer.tokenize
    monkeypatch.setattr(service.tokenizer, "tokenize", lambda text: seen.append(len(text)) or tokenize(text))
    huge = "5 " * 1_900_000 + "5"  # 3.8 MB: under the 4 MiB body limit, ~1.9M tokens
    answers = {}

    def send():
        answers["huge"] = httpx.post(f"{url}/v1/completions", json={"prompt": huge, "max_tokens": 1}, timeout=60)

    sender = threading.Thread(target=send)
    sender.start()
    health = []
    while sender.is_alive():
        start = time.perf_counter()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        health.append(time.perf_counter() - start)
    sender.join()
    reply = answers["huge"]
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "prompt" and "--max-model-len" in error["message"] and "characters" in error["message"]
    assert all(length < len(huge) for length in seen)  # never tokenized (the vocabulary's scan is short texts)
    assert max(health) < 1.0, health  # before: seconds while it was tokenized
    fine = httpx.post(f"{url}/v1/completions", json={"prompt": "5 " * 20 + "5", "max_tokens": 2, "temperature": 0})
    assert fine.status_code == 200  # a prompt that fits is still tokenized and served


def test_the_waiting_queue_is_bounded_with_429_and_retry_after(parts, monkeypatch):
    engine, _ = parts
    release = held_engine(monkeypatch, engine)
    with server(parts, max_queued_sequences=3) as (url, service):
        results = {}

        def hold(name, n):
            results[name] = httpx.post(f"{url}/v1/completions", json={"prompt": "5 6", "max_tokens": 2, "n": n,
                                                                      "temperature": 0}, timeout=60)

        holders = [threading.Thread(target=hold, args=("two", 2)), threading.Thread(target=hold, args=("one", 1))]
        for thread in holders:
            thread.start()
        deadline = time.monotonic() + 30
        while service.admission.in_flight < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.admission.in_flight == 3
        busy = httpx.post(f"{url}/v1/completions", json={"prompt": "5", "max_tokens": 1})
        busy_api = httpx.put(f"{url}/api", json={"prompts": ["5"], "tokens_to_generate": 1})
        never = httpx.post(f"{url}/v1/completions", json={"prompt": "5", "max_tokens": 1, "n": 4})
        release.set()
        for thread in holders:
            thread.join()
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["type"] == "rate_limit_error" and "--max-num-queued-reqs" in busy.text
        assert busy_api.status_code == 429
        assert never.status_code == 400 and never.json()["error"]["param"] == "prompt"
        assert results["two"].status_code == 200 and results["one"].status_code == 200
        assert service.admission.in_flight == 0  # every place given back
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "5", "max_tokens": 1}).status_code == 200


def test_a_non_streaming_request_is_cancelled_when_its_client_goes(parts, monkeypatch):
    finish_reasons = []
    with server(parts) as (url, service):
        worker = service.worker  # the one loop: its decode step hands out tokens and endings
        on_token, finish = worker._decode_step.on_token, worker._finish

        def slow_on_token(*args):  # 20 ms a token: the client leaves long before 50 tokens
            time.sleep(0.02)
            on_token(*args)

        def recording_finish(sequence):
            finish_reasons.append(sequence.finish_reason)
            finish(sequence)

        monkeypatch.setattr(worker._decode_step, "on_token", slow_on_token)
        monkeypatch.setattr(worker._decode_step, "on_finish", recording_finish)
        monkeypatch.setattr(worker, "_finish", recording_finish)
        for route, body in (("/v1/completions", {"prompt": "2 7 1 8", "max_tokens": 50, "temperature": 0}),
                            ("/api", {"prompts": ["2 7 1 8"], "tokens_to_generate": 50, "top_k": 1})):
            method = "PUT" if route == "/api" else "POST"
            with pytest.raises(httpx.ReadTimeout):
                httpx.request(method, f"{url}{route}", json=body, timeout=0.3)
            deadline = time.monotonic() + 30
            while service.admission.in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
            assert service.admission.in_flight == 0, route
        assert finish_reasons == ["cancelled", "cancelled"]
        metrics = httpx.get(f"{url}/metrics").text
        assert 'route="/v1/completions",status="499"' in metrics


def test_the_gauges_read_zero_on_an_idle_server(plain):
    url, _ = plain
    for _ in range(2):
        assert httpx.post(f"{url}/v1/completions", json={"prompt": ["5 6", "7"], "max_tokens": 3}).status_code == 200
    values = dict(line.rsplit(" ", 1) for line in httpx.get(f"{url}/metrics").text.splitlines()
                  if line.startswith(("mega_running_sequences", "mega_queued_sequences")))
    assert values == {"mega_running_sequences": "0", "mega_queued_sequences": "0"}


def test_a_library_tokenizer_lets_the_event_loop_run_while_it_encodes(tmp_path):
    """The Hugging Face tokenizer (the byte-level one of test_real_clients): the service encodes
    through its batch encoder, which releases the GIL, to the same ids as ``encode``; the main
    thread keeps running meanwhile (with the single ``encode`` it would wait for the whole text)."""
    from mega.data.tokenizers.huggingface import HuggingFaceTokenizer
    from mega.inference.http.service import encode

    hf_byte_level_directory(tmp_path, POSITIONS)
    tokenizer = HuggingFaceTokenizer(str(tmp_path))
    text = "héllo wörld, " * 200_000  # 2.6 M characters: a ~100 ms encode
    assert encode(tokenizer, text[:5000]) == tokenizer.tokenize(text[:5000])
    result, wakeups = {}, 0
    worker = threading.Thread(target=lambda: result.update(ids=encode(tokenizer, text)))
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        wakeups += 1
    worker.join()
    assert len(result["ids"]) == len(text.encode())  # byte-level: a token per byte
    assert wakeups >= 20, wakeups
