"""Tool calls in chat answers: the format a family's chat template teaches its model, the parser
that finds the calls in the generated text, and the grammar that makes a call certain
(``tool_choice`` ``required`` or a named function).

Formats (read off the template's text):

- ``hermes`` (Qwen 2.5/3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, text around them is content;
- ``deepseek`` (DeepSeek V3/R1): ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then a
  JSON code block of the arguments and ``<｜tool▁call▁end｜>``;
- ``llama3_json`` (Llama 3.1+, and any template without markers): the whole answer is one JSON
  object ``{"name": ..., "parameters": {...}}`` (several separated by ``;``).

A forced call is generated under a grammar (:class:`~mega.inference.engine.grammar.Constraint`
``lark``, llguidance's Lark with ``%json`` for the arguments' schema), so it always parses.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from mega.inference.engine.grammar import JSON_LAYOUT, Constraint

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
DEEPSEEK_CALLS_OPEN, DEEPSEEK_CALLS_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_OPEN, DEEPSEEK_SEP, DEEPSEEK_CLOSE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's answers carry it

    def as_openai(self, index: int) -> dict:
        return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def format_of(template_source: str) -> str:
    """The tool-call format a chat template teaches."""
    if HERMES_OPEN in template_source:
        return "hermes"
    if DEEPSEEK_OPEN in template_source or "tool▁call▁begin" in template_source:
        return "deepseek"
    return "llama3_json"


def call_start(format_name: str) -> str:
    """The text that opens a call: streamed text from there on is held back as a call."""
    return {"hermes": HERMES_OPEN, "deepseek": DEEPSEEK_CALLS_OPEN, "llama3_json": "{"}[format_name]


def parse(text: str, format_name: str) -> tuple[str, list[ToolCall]]:
    """(content left, calls) of a generated answer; text that does not parse as a call stays content."""
    if format_name == "hermes":
        calls, content = [], text
        for match in re.finditer(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), text, re.S):
            call = _json_call(match.group(1), "arguments")
            if call is not None:
                calls.append(call)
                content = content.replace(match.group(0), "", 1)
        return content.strip() if calls else text, calls
    if format_name == "deepseek":
        pattern = (re.escape(DEEPSEEK_OPEN) + r"function" + re.escape(DEEPSEEK_SEP) + r"(.*?)\n```json\n(.*?)\n```\s*"
                   + re.escape(DEEPSEEK_CLOSE))
        calls = [ToolCall(m.group(1).strip(), _compact(m.group(2))) for m in re.finditer(pattern, text, re.S)
                 if _compact(m.group(2)) is not None]
        if not calls:
            return text, []
        return text.split(DEEPSEEK_CALLS_OPEN)[0].strip(), calls
    stripped = text.strip().removeprefix("<|python_tag|>")
    if not stripped.startswith("{"):
        return text, []
    calls = [_json_call(part, "parameters", "arguments") for part in stripped.split(";")]
    if not calls or any(call is None for call in calls):
        return text, []
    return "", calls


def _compact(arguments: str) -> str | None:
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        return None


def _json_call(text: str, *argument_keys: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in argument_keys if k in value), None)
    arguments = value.get(key, {}) if key else {}
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def forced_call(tools: list[dict], format_name: str, name: str | None) -> Constraint:
    """The grammar of one call to ``name`` (or to any of ``tools``): what ``tool_choice``
    ``required`` or a named function generates."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    argument_key = "parameters" if format_name == "llama3_json" else "arguments"
    if format_name == "deepseek":
        alternatives = " | ".join(f"call_{k}" for k in range(len(chosen)))
        rules = [f"call_{k}: {json.dumps(t['function']['name'])} \"\\n```json\\n\" args_{k} \"\\n```\"\n"
                 f"args_{k}: %json {json.dumps({**_parameters(t), 'x-guidance': JSON_LAYOUT})}"
                 for k, t in enumerate(chosen)]
        lark = (f"start: {json.dumps(DEEPSEEK_CALLS_OPEN + DEEPSEEK_OPEN + 'function' + DEEPSEEK_SEP)} call "
                f"{json.dumps(DEEPSEEK_CLOSE + DEEPSEEK_CALLS_CLOSE)}\ncall: {alternatives}\n" + "\n".join(rules))
        return Constraint("lark", lark)
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                          argument_key: _parameters(t)},
                         "required": ["name", argument_key], "additionalProperties": False} for t in chosen],
              "x-guidance": JSON_LAYOUT}
    if format_name == "llama3_json":
        return Constraint("json_schema", schema)
    return Constraint("lark", f"start: {json.dumps(HERMES_OPEN + chr(10))} call {json.dumps(chr(10) + HERMES_CLOSE)}\n"
                              f"call: %json {json.dumps(schema)}")


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}
