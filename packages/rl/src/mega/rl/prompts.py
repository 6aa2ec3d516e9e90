"""Prompt data for RL: ``--prompt-data FILE.jsonl``, and a seeded iterator over it that resumes
exactly where it stopped.

Each line is a JSON object with ``prompt`` (text given to the model as it is) or ``messages`` (a
conversation, rendered by the tokenizer's chat template with the generation prompt added), and any
other keys, which reach the reward functions as keyword arguments with the completion (``answer``
for the math reward, ``format_regex`` for the format reward...). A ``messages`` line keeps its
``messages`` among those fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mega.data.chat_template import ChatTemplateError, find_chat_template, load_chat_template


class PromptDataError(ValueError):
    """A prompt file or line that cannot be used; the message names the file and line."""


@dataclass
class Prompt:
    text: str                                   # what the model continues
    fields: dict[str, Any] = field(default_factory=dict)  # the line's other keys, for the rewards
    where: str = ""                             # "FILE:LINE", for messages about this prompt


def _conversation_error(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "`messages` must be a non-empty list of {\"role\": ..., \"content\": ...} objects"
    for index, message in enumerate(messages, 1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            return f"message {index} must be an object with string `role` and `content`"
    return None


def prompt_chat_template(chat_template: str | None, tokenizer_path: str | None):
    """The template ``messages`` lines are rendered with: ``--chat-template FILE`` (a Jinja file or
    a ``tokenizer_config.json``), else the one beside the tokenizer's files, else None."""
    try:
        return load_chat_template(chat_template) if chat_template else find_chat_template(tokenizer_path)
    except ChatTemplateError as error:
        raise PromptDataError(str(error)) from None


def read_prompt_data(path: str | Path, chat_template=None) -> list[Prompt]:
    """Every prompt of a JSON Lines file (blank lines skipped). ``chat_template``: a
    :class:`mega.data.chat_template.ChatTemplate`, needed when a line has ``messages``."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise PromptDataError(f"--prompt-data {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PromptDataError(f"--prompt-data {path}: cannot be read: {error}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptDataError(f"{where}: not valid JSON: {error.msg} (column {error.colno})") from None
        if not isinstance(record, dict):
            raise PromptDataError(f"{where}: a line must be a JSON object, got {type(record).__name__}")
        if ("prompt" in record) == ("messages" in record):
            raise PromptDataError(f"{where}: a line needs exactly one of `prompt` (text) and `messages` "
                                  f"(a conversation); it has {'both' if 'prompt' in record else 'neither'}")
        fields = {key: value for key, value in record.items() if key != "prompt"}
        if "prompt" in record:
            if not isinstance(record["prompt"], str) or not record["prompt"]:
                raise PromptDataError(f"{where}: `prompt` must be a non-empty string")
            text = record["prompt"]
        else:
            problem = _conversation_error(record["messages"])
            if problem:
                raise PromptDataError(f"{where}: {problem}")
            if chat_template is None:
                raise PromptDataError(f"{where}: `messages` needs a chat template: the tokenizer's "
                                      "(tokenizer_config.json or chat_template.jinja beside it) or --chat-template FILE")
            try:
                text, _ = chat_template.render(record["messages"], add_generation_prompt=True)
            except ChatTemplateError as error:
                raise PromptDataError(f"{where}: {error}") from None
        prompts.append(Prompt(text, fields, where))
    if not prompts:
        raise PromptDataError(f"--prompt-data {path}: holds no prompt")
    return prompts


class PromptIterator:
    """Batches of prompts in a seeded random order, epoch after epoch.

    Epoch ``e`` visits every prompt once in the order ``default_rng([seed, e]).permutation(n)``
    (``shuffle=False``: file order), so the state is the seed, the epoch and the position in it:
    :meth:`state_dict` holds them and :meth:`load_state_dict` continues exactly where the saved
    iterator would have, draws included.
    """

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool = True) -> None:
        if not prompts:
            raise ValueError("no prompts to iterate over")
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.prompts))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def next_batch(self, count: int) -> list[Prompt]:
        """The next ``count`` prompts (``--grpo-prompts-per-step``), across an epoch's end."""
        if count < 1:
            raise ValueError(f"a batch needs at least one prompt, got {count}")
        batch = []
        while len(batch) < count:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            batch.append(self.prompts[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle, "epoch": self.epoch, "position": self.position,
                "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_prompts"] != len(self.prompts):
            raise ValueError(f"the saved prompt position is for {state['num_prompts']} prompts, the prompt data "
                             f"now has {len(self.prompts)}: resuming would not see the same prompts")
        if state["seed"] != self.seed or state["shuffle"] != self.shuffle:
            raise ValueError(f"the saved prompt order was drawn with seed {state['seed']} (shuffle "
                             f"{state['shuffle']}), this run has seed {self.seed} (shuffle {self.shuffle})")
        if not 0 <= state["position"] <= len(self.prompts):
            raise ValueError(f"the saved prompt position {state['position']} is outside 0..{len(self.prompts)}")
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._epoch_order(self.epoch)
