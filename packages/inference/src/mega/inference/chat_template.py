"""A tokenizer's chat template (Hugging Face's ``chat_template``), found beside its files and
rendered the way ``transformers``' ``apply_chat_template`` renders it.

The template is the ``chat_template`` of the ``tokenizer_config.json`` next to the tokenizer's
files (a Hugging Face directory, or a mega checkpoint's ``tokenizer/``), or a
``chat_template.jinja`` there. It is rendered in a sandboxed Jinja environment with the
conversation as ``messages``, ``add_generation_prompt=True``, and the tokenizer's special
token strings (``bos_token``, ``eos_token``...), loop controls and ``{% generation %}`` blocks
(their content) as transformers has them; the text is then tokenized without adding special
tokens, as ``apply_chat_template(tokenize=True)`` does. ``mega serve``'s chat route and ``mega
generate --chat`` both render through :class:`ChatTemplate`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

FILE_OPTIONS = ("tokenizer_model", "vocab_file", "merge_file")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")


ROLES = ("system", "developer", "user", "assistant", "tool")  # the roles of OpenAI's chat messages


class ChatTemplateError(ValueError):
    """The template cannot be rendered for these messages (its own ``raise_exception`` too)."""


def template_messages(messages) -> list[dict]:
    """A conversation as JSON gives it (``mega generate --chat``'s files) checked and put as
    templates read it: each message a ``role`` among :data:`ROLES` and a ``content`` string (a
    list of ``{"type": "text", "text": ...}`` parts is joined), its ``name`` kept."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages: must be a non-empty list of {\"role\", \"content\"} objects")
    result = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ChatTemplateError(f"{where}: needs a role among {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ChatTemplateError(f"{where}.content: a list of {{\"type\": \"text\", \"text\": ...}} parts")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise ChatTemplateError(f"{where}.content: must be a string or a list of text parts")
        entry = {"role": message["role"], "content": content or ""}
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        result.append(entry)
    return result


@dataclass
class ChatTemplate:
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    def render(self, messages: list[dict]) -> str:
        # start-up cost: jinja2 loads only when a chat template is rendered
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ChatTemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[_generation_tag(), "jinja2.ext.loopcontrols"])
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        try:
            template = environment.from_string(self.source)
            return template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the tokenizer's chat template failed: {error}") from None


def _generation_tag():
    """``{% generation %}...{% endgeneration %}`` (training templates mark the assistant's text with
    it) renders its content, as transformers renders it when no mask is asked for."""
    # start-up cost, as in ChatTemplate.render
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


def find_chat_template(spec) -> ChatTemplate | None:
    """The chat template beside the files of ``spec`` (a TokenizerSpec), or None."""
    if spec is None:
        return None
    for option in FILE_OPTIONS:
        path = getattr(spec.options, option, None)
        if not path:
            continue
        directory = Path(path) if Path(path).is_dir() else Path(path).parent
        template = _template_in(directory)
        if template is not None:
            return template
    return None


def _template_in(directory: Path) -> ChatTemplate | None:
    config = _read_config(directory / "tokenizer_config.json")
    source = _source_of(config)
    jinja_file = directory / "chat_template.jinja"
    if not source and jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    return ChatTemplate(source, special_tokens_of(config)) if source else None


def chat_template_file(path: str | Path, special_tokens: dict[str, str] | None = None) -> ChatTemplate:
    """``--chat-template FILE``: a Jinja file (rendered with ``special_tokens``, the tokenizer's), or
    a ``tokenizer_config.json`` holding a ``chat_template`` (and its own special tokens)."""
    path = Path(path)
    if path.suffix == ".json":
        config = _read_config(path)
        source = _source_of(config)
        if not source:
            raise ChatTemplateError(f"--chat-template {path}: holds no chat_template")
        return ChatTemplate(source, special_tokens_of(config))
    try:
        return ChatTemplate(path.read_text(encoding="utf-8"), dict(special_tokens or {}))
    except (OSError, UnicodeDecodeError) as error:
        raise ChatTemplateError(f"--chat-template {path}: cannot be read ({error})") from None


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        config = {}
    return config if isinstance(config, dict) else {}


def _source_of(config: dict) -> str | None:
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    return source if isinstance(source, str) and source else None


def special_tokens_of(config: dict) -> dict[str, str]:
    """The special-token strings (``bos_token``...) a template is rendered with."""
    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            special[key] = value
    return special
