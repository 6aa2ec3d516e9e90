"""Tool calls and reasoning against real ``mega serve`` processes on 127.0.0.1 (CPU, pinned by
``--device cpu``), driven by the official ``openai`` client: ``tool_choice`` ``required`` and a
named function give ``tool_calls`` that parse, whole and streamed, in Llama 3's JSON format (a
template without markers: test_real_clients' server) and Qwen/Hermes' ``<tool_call>`` blocks (a
template that teaches them, served with ``--reasoning-parser qwen3``); a ``tool`` message
continues the conversation; ``<think>`` text lands in ``reasoning_content``.

The model is a tiny random GPT-2 over bytes: a call parses because the grammar forced it, and the
reasoning test forces its text's shape with ``guided_regex``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import test_real_clients  # noqa: E402
from tiny_models import hf_byte_level_directory  # noqa: E402

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

server, client = test_real_clients.server, test_real_clients.client  # Llama 3 JSON calls (no markers)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the forecast",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
HERMES_TEMPLATE = (
    "{% if tools %}<|system|>Tools: {% for tool in tools %}{{ tool.function.name }} {% endfor %}"
    "Call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
    "{% for message in messages %}{% if message.role == 'assistant' and message.tool_calls %}<|assistant|>"
    "{% for call in message.tool_calls %}<tool_call>{{ {'name': call.function.name, 'arguments': "
    "call.function.arguments} | tojson }}</tool_call>{% endfor %}\n"
    "{% elif message.role == 'tool' %}<|tool|><tool_response>{{ message.content }}</tool_response>\n"
    "{% else %}<|{{ message.role }}|>{{ message.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def hermes_client(tmp_path_factory):
    directory = tmp_path_factory.mktemp("byte-gpt2-hermes")
    hf_byte_level_directory(directory, 384)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE, "model_max_length": 384}))
    for url in test_real_clients.serve(directory, "--reasoning-parser", "qwen3"):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _model(openai_client) -> str:
    return openai_client.models.list().data[0].id


def _check_calls(calls, names: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.function.name in names and call.id
        arguments = json.loads(call.function.arguments)
        tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        for key in tool["function"]["parameters"]["required"]:
            assert key in arguments


def _streamed(stream) -> tuple[str, list, list]:
    """(content, tool calls as openai delta objects, finish reasons) of a one-choice stream."""
    content, calls, reasons = "", [], []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return content, calls, reasons


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_llama3_json_calls_whole_and_streamed(client, choice):
    names = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    for seed in range(3):
        reply = client.chat.completions.create(model=_model(client), messages=ASK, tools=TOOLS, tool_choice=choice,
                                               max_tokens=80, seed=seed)
        assert reply.choices[0].finish_reason == "tool_calls"
        _check_calls(reply.choices[0].message.tool_calls, names)
        content, calls, reasons = _streamed(client.chat.completions.create(
            model=_model(client), messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=80, seed=seed,
            stream=True))
        assert reasons == ["tool_calls"] and content == ""
        _check_calls(calls, names)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_hermes_calls_whole_and_streamed(hermes_client, choice):
    names = {"get_weather", "get_time"} if choice == "required" else {"get_weather"}
    model = _model(hermes_client)
    for seed in range(3):
        reply = hermes_client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                      max_tokens=120, seed=seed)
        assert reply.choices[0].finish_reason == "tool_calls"
        _check_calls(reply.choices[0].message.tool_calls, names)
        _, calls, reasons = _streamed(hermes_client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120, seed=seed, stream=True))
        assert reasons == ["tool_calls"]
        _check_calls(calls, names)


def test_a_tool_message_continues_the_conversation(hermes_client):
    model = _model(hermes_client)
    first = hermes_client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                  max_tokens=120, seed=1)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = hermes_client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                                   max_tokens=8, temperature=0)
    assert second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + len("sunny, 21 C")


def test_think_text_goes_to_reasoning_content(hermes_client):
    model = _model(hermes_client)
    shape = {"guided_regex": "<think>[a-z]{3,8}</think>[A-Z]{3,8}"}
    reply = hermes_client.chat.completions.create(model=model, messages=ASK, max_tokens=40, seed=2, extra_body=shape)
    message = reply.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning.isalpha() and reasoning.islower() and message.content.isupper()
    reasoning_parts, content = [], ""
    for chunk in hermes_client.chat.completions.create(model=model, messages=ASK, max_tokens=40, seed=2,
                                                       extra_body=shape, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            reasoning_parts.append((delta.model_extra or {}).get("reasoning_content") or "")
            content += delta.content or ""
    assert "".join(reasoning_parts) == reasoning and content == message.content
