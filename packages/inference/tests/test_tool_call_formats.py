"""Each tool-call format's forced-call grammar, compiled by llguidance for a real byte-level
tokenizer, accepts the call a model of that family writes (DeepSeek's included, which no tiny
server here is templated for), and the parser reads the same call back. CPU only (no model)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import BYTE_VOCAB, hf_byte_level_directory  # noqa: E402

pytest.importorskip("llguidance")
from mega.data.tokenizers.huggingface import HuggingFaceTokenizer  # noqa: E402
from mega.inference.engine.grammar import GrammarCompiler  # noqa: E402
from mega.inference.http import tool_calls  # noqa: E402

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}
OTHER = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
WRITTEN = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "deepseek": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                 '{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
}


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bytes")
    hf_byte_level_directory(directory, 64)
    tokenizer = HuggingFaceTokenizer(str(directory))
    return tokenizer, GrammarCompiler(tokenizer, BYTE_VOCAB)


@pytest.mark.parametrize("format_name", sorted(WRITTEN))
def test_the_forced_call_accepts_what_the_family_writes_and_parses_back(compiler, format_name):
    tokenizer, grammars = compiler
    text = WRITTEN[format_name]
    grammar = grammars.compile(tool_calls.forced_call([TOOL, OTHER], format_name, "get_weather"), "tool_choice")
    state = grammar.start()
    for token in tokenizer.tokenize(text) + [tokenizer.eod]:
        assert state.matcher.consume_token(token), state.matcher.get_error()
    assert state.matcher.is_accepting()
    content, [call] = tool_calls.parse(text, format_name)
    assert content == "" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}


@pytest.mark.parametrize("format_name", sorted(WRITTEN))
def test_the_forced_call_refuses_another_tool_or_bad_arguments(compiler, format_name):
    tokenizer, grammars = compiler
    grammar = grammars.compile(tool_calls.forced_call([TOOL, OTHER], format_name, "get_weather"), "tool_choice")
    for wrong in (WRITTEN[format_name].replace("get_weather", "get_time"), WRITTEN[format_name].replace("Oslo", "Rome")):
        state = grammar.start()
        tokens = tokenizer.tokenize(wrong)
        assert state.matcher.try_consume_tokens(tokens) < len(tokens)


def test_template_markers_choose_the_format():
    assert tool_calls.format_of("{{ '<tool_call>' }}") == "hermes"
    assert tool_calls.format_of("<｜tool▁call▁begin｜>") == "deepseek"
    assert tool_calls.format_of("{{ messages }}") == "llama3_json"
    assert tool_calls.parse("plain words", "hermes") == ("plain words", [])
