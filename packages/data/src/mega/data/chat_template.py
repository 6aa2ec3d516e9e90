"""Chat templates for ``mega preprocess --chat``: a conversation rendered to text, and which
characters of that text the assistant wrote.

The template is Hugging Face's ``chat_template`` (a Jinja string in ``tokenizer_config.json``
beside the tokenizer, or a ``chat_template.jinja`` there), or any Jinja file given with
``--chat-template``. It renders as ``transformers``' ``apply_chat_template`` renders it: a
sandboxed environment with ``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``,
``strftime_now``, a ``tojson`` that does not escape HTML, and the tokenizer's special-token strings.

The assistant's characters are the template's own ``{% generation %}`` blocks where it has them
(what ``return_assistant_tokens_mask`` uses). A template without them is rendered turn by turn:
the text an assistant message adds after the prompt for it (``add_generation_prompt``) is its
turn, its content and whatever closes the turn (an end-of-turn token), which the model must
learn to produce.
"""

from __future__ import annotations

import json
import os
import re
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
STANDARD_ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """The template is missing, does not compile, or cannot render a conversation."""


# (chunks rendered so far, spans found) of the render in progress; the ``generation`` tag reads it.
_TRACKING: ContextVar = ContextVar("mega_chat_generation_spans", default=None)


def _generation_extension():
    # start-up cost: jinja2 loads only when a chat template is compiled
    import jinja2
    from jinja2.ext import Extension

    class GenerationSpans(Extension):
        """``{% generation %}...{% endgeneration %}``: records where its output lands."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

        def _record(self, caller):
            text = caller()
            tracking = _TRACKING.get()
            if tracking is not None:
                chunks, spans = tracking
                start = sum(map(len, chunks))
                spans.append((start, start + len(text)))
            return text

    return GenerationSpans


@dataclass
class ChatTemplate:
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    origin: str = "the chat template"

    def __post_init__(self):
        # start-up cost, as above
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ChatTemplateError(message)

        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), "jinja2.ext.loopcontrols"])
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        environment.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, indent=indent,
                                                                                  ensure_ascii=False)
        try:
            self._template = environment.from_string(self.source)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"{self.origin} does not compile: {error}") from None
        self.has_generation_blocks = re.search(r"{%-?\s*generation\s*-?%}", self.source) is not None

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles the template knows: among system, user, assistant and tool, those it names as
        string literals when it tells roles apart (it names ``user``), else all four (a template
        that writes any role as it is, as ChatML does)."""
        named = tuple(role for role in STANDARD_ROLES if re.search(rf"['\"]{role}['\"]", self.source))
        return named if "user" in named else STANDARD_ROLES

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The text, and the ``(start, end)`` character spans of its ``{% generation %}`` blocks."""
        # start-up cost, as above
        import jinja2

        chunks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _TRACKING.set((chunks, spans))
        try:
            for chunk in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 **self.special_tokens):
                chunks.append(chunk)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"{self.origin} failed: {error}") from None
        finally:
            _TRACKING.reset(token)
        return "".join(chunks), spans

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation's text and the character spans the assistant wrote."""
        text, spans = self.render(messages)
        if self.has_generation_blocks:
            return text, [span for span in spans if span[1] > span[0]]
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt, _ = self.render(messages[:index], add_generation_prompt=True)
            turn, _ = self.render(messages[: index + 1])
            if not turn.startswith(prompt) or not text.startswith(turn):
                raise ChatTemplateError(
                    f"{self.origin} does not render message {index + 1} as a continuation of the messages before "
                    f"it, so its turn cannot be told apart; add {{% generation %}} blocks to the template")
            spans.append((len(prompt), len(turn)))
        return text, spans


def load_chat_template(path: str, special_tokens: dict[str, str] | None = None) -> ChatTemplate:
    """``--chat-template FILE``: a Jinja file, or a ``tokenizer_config.json`` holding one."""
    try:
        with open(path, encoding="utf-8") as stream:
            source = stream.read()
    except OSError as error:
        raise ChatTemplateError(f"--chat-template {path}: {error.strerror or error}") from None
    if path.endswith(".json"):
        found = _template_of_config(path)
        if found is None:
            raise ChatTemplateError(f"--chat-template {path}: holds no chat_template")
        return found
    return ChatTemplate(source, dict(special_tokens or {}), origin=f"--chat-template {path}")


def find_chat_template(tokenizer_path: str | None) -> ChatTemplate | None:
    """The chat template beside a tokenizer's file (or in its directory), or None."""
    if not tokenizer_path:
        return None
    directory = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)
    config_path = os.path.join(directory, "tokenizer_config.json")
    template = _template_of_config(config_path) if os.path.isfile(config_path) else None
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_path):
        special = template_special_tokens(config_path) if os.path.isfile(config_path) else {}
        template = load_chat_template(jinja_path, special)
    return template


def template_special_tokens(config_path: str) -> dict[str, str]:
    """``bos_token``, ``eos_token``... strings of a ``tokenizer_config.json``."""
    config = _read_json(config_path)
    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[key] = value
    return special


def _template_of_config(config_path: str) -> ChatTemplate | None:
    source = _read_json(config_path).get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((entry.get("template") for entry in source if entry.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, template_special_tokens(config_path), origin=f"the chat template of {config_path}")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as stream:
            config = json.load(stream)
    except (OSError, ValueError) as error:
        raise ChatTemplateError(f"{path}: cannot be read ({error})") from None
    return config if isinstance(config, dict) else {}
