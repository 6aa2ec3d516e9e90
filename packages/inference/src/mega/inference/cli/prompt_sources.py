"""Where ``mega generate``'s prompts come from: ``--prompt`` (repeatable), ``--prompt-file``
(``-`` is stdin) or stdin, as plain lines or as JSON lines.

A plain file holds one prompt per line. A JSON-lines file (``--chat``, or a ``.jsonl`` file)
holds one object per line: ``{"prompt": "..."}`` (newlines and all) or, with ``--chat``,
``{"messages": [{"role": ..., "content": ...}, ...]}``; blank lines are skipped. With ``--chat``
a plain prompt is a user message after ``--system``'s. A line that is none of these ends the
command with the file and line number.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from mega.inference.chat_template import ChatTemplateError, template_messages


@dataclass(frozen=True)
class Prompt:
    """A plain prompt (``text``) or a conversation (``messages``) to render with the chat template."""

    text: str | None = None
    messages: list[dict] | None = None


class PromptError(ValueError):
    """A prompt that cannot be read; the message names the file and line."""


def read_prompts(args: argparse.Namespace) -> list[Prompt]:
    prompts = [_plain(text, args) for text in args.prompt]
    stream = None
    if args.prompt_file:
        stream = sys.stdin if args.prompt_file == "-" else open(args.prompt_file, encoding="utf-8")
    elif not prompts:
        if sys.stdin.isatty():
            raise PromptError("give --prompt TEXT, --prompt-file PATH, or prompts on stdin")
        stream = sys.stdin
    if stream is not None:
        name = "stdin" if stream is sys.stdin else args.prompt_file
        json_lines = args.chat or name.endswith(".jsonl")
        with stream:
            lines = [line.rstrip("\r\n") for line in stream]
        if json_lines:
            prompts += [prompt for number, line in enumerate(lines, 1) if line.strip()
                        for prompt in [_json_line(line, f"{name}:{number}", args)]]
        else:
            prompts += [_plain(line, args) for line in lines]
    return prompts


def _plain(text: str, args: argparse.Namespace) -> Prompt:
    if not args.chat:
        return Prompt(text=text)
    system = [{"role": "system", "content": args.system}] if args.system else []
    return Prompt(messages=[*system, {"role": "user", "content": text}])


def _json_line(line: str, where: str, args: argparse.Namespace) -> Prompt:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise PromptError(f"{where}: not a JSON object ({error})") from None
    if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
        raise PromptError(f"{where}: an object with \"prompt\" (text) or \"messages\" (a conversation), one of them")
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise PromptError(f"{where}: \"prompt\" must be a string")
        return _plain(record["prompt"], args)
    if not args.chat:
        raise PromptError(f"{where}: \"messages\" is a conversation: give --chat to render it with the chat template")
    try:
        return Prompt(messages=template_messages(record["messages"]))
    except ChatTemplateError as error:
        raise PromptError(f"{where}: {error}") from None
