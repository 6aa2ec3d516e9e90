"""A tokenizer's chat template (Hugging Face's ``chat_template``), found beside its files and
rendered the way ``transformers``' ``apply_chat_template`` renders it.

The template is the ``chat_template`` of the ``tokenizer_config.json`` next to the tokenizer's
files (a Hugging Face directory, or a mega checkpoint's ``tokenizer/``), or a
``chat_template.jinja`` there. It is rendered in a sandboxed Jinja environment with the
conversation as ``messages``, ``add_generation_prompt=True``, and the tokenizer's special
token strings (``bos_token``, ``eos_token``...); the text is then tokenized without adding
special tokens, as ``apply_chat_template(tokenize=True)`` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

FILE_OPTIONS = ("tokenizer_model", "vocab_file", "merge_file")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template cannot be rendered for these messages (its own ``raise_exception`` too)."""


@dataclass
class ChatTemplate:
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        # start-up cost: jinja2 loads only when a chat template is rendered
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ChatTemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        try:
            template = environment.from_string(self.source)
            extra = {"tools": tools} if tools else {}  # templates test `tools is defined` or `if tools`
            return template.render(messages=messages, add_generation_prompt=True, **self.special_tokens, **extra)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the tokenizer's chat template failed: {error}") from None


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
    config: dict = {}
    config_path = directory / "tokenizer_config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    jinja_file = directory / "chat_template.jinja"
    if not source and jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    if not isinstance(source, str) or not source:
        return None
    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            special[key] = value
    return ChatTemplate(source, special)
