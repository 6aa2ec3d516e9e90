"""Structured outputs against a real ``mega serve`` process on 127.0.0.1 (CPU, pinned by
``--device cpu``), driven by the official ``openai`` client and checked by ``jsonschema``:
``response_format`` ``json_schema`` and ``json_object``, vLLM's ``guided_choice`` and
``guided_regex``, whole and streamed, constrained sequences batched with unconstrained ones.

The model is a tiny random GPT-2 over a byte-level vocabulary (test_real_clients' server): what it
would write is noise, so every valid answer is the grammar's doing. For ``json_object`` (any
object, strings of any length) the requests bias the closing quote and brace up, so a random
model's strings end within ``max_tokens``; the grammar still decides every token.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import test_real_clients  # noqa: E402

server, client = test_real_clients.server, test_real_clients.client  # its real server and openai client fixtures

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")

# Nested: an object in an object, an array of enums, an enum, a pattern, bounded integers, required keys.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2},
        "owner": {"type": "object",
                  "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99},
                                 "verified": {"type": "boolean"}},
                  "required": ["age", "verified"], "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
ANSWERS = 100
MAX_TOKENS = 102  # the longest answer the schema allows is 101 tokens, then the end of text
# The byte-level vocabulary: token id = the byte's place in ByteLevel's alphabet; '"' and '}' by text.
CLOSING_BIAS = 4.0


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _byte_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_json_schema_answers_parse_and_validate(client, model):
    """100 sampled answers (n=50, twice), whole: each parses and validates, or is cut at its length."""
    texts = []
    for seed in (1, 2):
        reply = client.completions.create(model=model, prompt="A pet as JSON:", max_tokens=MAX_TOKENS, n=ANSWERS // 2,
                                          seed=seed, extra_body={"response_format": SCHEMA_FORMAT})
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice.text  # the schema's answers fit MAX_TOKENS
            texts.append(choice.text)
    assert len(texts) == ANSWERS
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > ANSWERS // 2  # sampled: not one answer a hundred times


def test_json_schema_streamed_chat(client, model):
    """Chat, streamed, n=100: every choice's deltas join into a valid answer."""
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Pet"}],
                                            max_tokens=MAX_TOKENS, n=ANSWERS, seed=3, stream=True,
                                            response_format=SCHEMA_FORMAT)
    texts, reasons = [""] * ANSWERS, [None] * ANSWERS
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert reasons == ["stop"] * ANSWERS
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_answers_whole_and_streamed(server, client, model):
    tokenizer = server[2]
    bias = {str(_byte_ids(tokenizer, c)[0]): CLOSING_BIAS for c in '"}'}
    whole = client.completions.create(model=model, prompt="JSON:", max_tokens=MAX_TOKENS, n=ANSWERS, seed=4,
                                      logit_bias=bias, extra_body={"response_format": {"type": "json_object"}})
    texts = [c.text for c in whole.choices if c.finish_reason == "stop"]
    stream = client.completions.create(model=model, prompt="JSON:", max_tokens=MAX_TOKENS, n=ANSWERS, seed=5,
                                       logit_bias=bias, stream=True,
                                       extra_body={"response_format": {"type": "json_object"}})
    streamed, reasons = [""] * ANSWERS, [None] * ANSWERS
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    texts += [text for text, reason in zip(streamed, reasons, strict=True) if reason == "stop"]
    assert len(texts) == 2 * ANSWERS
    objects = [json.loads(text) for text in texts]
    assert all(isinstance(o, dict) for o in objects)
    assert any(objects)  # not only "{}"


def test_a_length_cut_is_reported_as_length(client, model):
    reply = client.completions.create(model=model, prompt="A pet as JSON:", max_tokens=5, n=4, seed=6,
                                      extra_body={"response_format": SCHEMA_FORMAT})
    for choice in reply.choices:
        assert choice.finish_reason == "length"
        with pytest.raises(json.JSONDecodeError):
            json.loads(choice.text)


def test_choice_and_regex_in_a_mixed_batch(client, model):
    """Constrained and unconstrained requests at once: each keeps to its own constraint (or none)."""
    import concurrent.futures

    choices = ["yes", "no", "maybe later"]

    def constrained(i):
        if i % 3 == 0:
            return "choice", client.completions.create(model=model, prompt=f"Q{i}?", max_tokens=20, seed=i,
                                                       extra_body={"guided_choice": choices}).choices[0]
        if i % 3 == 1:
            return "regex", client.completions.create(model=model, prompt=f"Q{i}?", max_tokens=30, seed=i,
                                                      extra_body={"guided_regex": r"[0-9]{3}-[a-c]{2,4}"}).choices[0]
        return "free", client.completions.create(model=model, prompt=f"Q{i}?", max_tokens=12, seed=i).choices[0]

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(constrained, range(24)))
    for kind, choice in answers:
        if kind == "choice":
            assert choice.text in choices and choice.finish_reason == "stop"
        elif kind == "regex":
            assert re.fullmatch(r"[0-9]{3}-[a-c]{2,4}", choice.text) and choice.finish_reason == "stop"
    free = [choice for kind, choice in answers if kind == "free"]
    assert all(choice.finish_reason in ("stop", "length") for choice in free)
    assert any(not re.fullmatch(r"[0-9]{3}-[a-c]{2,4}|yes|no|maybe later", c.text) for c in free)


def test_what_cannot_compile_is_a_400_naming_the_part(server):
    url = server[0]
    bad_regex = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "guided_regex": "(unclosed"})
    assert bad_regex.status_code == 400 and bad_regex.json()["error"]["param"] == "guided_regex"
    bad_schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "no-such-type"}}}
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "response_format": bad_schema})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "response_format.json_schema.schema"
    assert "no-such-type" in answer.json()["error"]["message"]
    both = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]})
    assert both.status_code == 400 and "at most one constraint" in both.json()["error"]["message"]
