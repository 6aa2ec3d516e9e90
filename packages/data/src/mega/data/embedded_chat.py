"""The embedded default's chat set (``--dataset pydoc-chat``): questions on Python's pydoc topics,
answered by the first sentence of each topic, for the demo's LoRA fine-tuning step.

It is built from the same corpus and tokenizer as ``pydoc-topics`` (mega.data.embedded_corpus):
each topic's title (``The "assert" statement``) asked three ways, answered by the first sentence of
its first paragraph, rendered by :data:`TEMPLATE` (the assistant's turn, ended by the corpus's
end-of-document token, is the only part in the loss) and preprocessed as ``mega preprocess
--chat`` would, once, into ``chat/`` beside the corpus (complete or not at all). The samples are
``mega train --sft``'s (packed with ``--packed-sequences``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from mega.core.datasets import DatasetRequest, TrainingData
from mega.core.tokenizer import TokenizerOptions
from mega.data.chat_encoder import chat_output_prefixes
from mega.data.embedded_corpus import END_OF_DOCUMENT, corpus_datasets, prepare
from mega.data.preprocess import PreprocessConfig, preprocess
from mega.data.sft_dataset import sft_datasets

NAME = "pydoc-chat"
QUESTIONS = ("Tell me about {}.", "What is {}?", "Explain {}.")
ANSWER_CHARS = 120  # about 45 tokens of the corpus's BPE: a question and its answer fit a 128-token row
# A turn is its role's tag, its text and a newline; the assistant's ends with the end of document instead.
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>"
            "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}" + END_OF_DOCUMENT + "{% endgeneration %}"
            "{% else %}{{ m.content }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def prompt(question: str) -> str:
    """What the fine-tuned model is asked: a user turn and the start of the assistant's."""
    return f"<|user|>{question}\n<|assistant|>"


def conversations(topics: dict[str, str]) -> list[dict]:
    """Each topic's title asked :data:`QUESTIONS`' ways, answered by its first paragraph's opening."""
    rows = []
    for name in sorted(topics):
        lines = topics[name].split("\n")
        title, body = lines[0].strip(), "\n".join(lines[2:])
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", body) if p.strip()]
        prose = next((p for p in paragraphs if p[0].isupper() and p.endswith((".", ":")) and "==" not in p
                      and not p.startswith(("New in", "Changed in"))), None)
        if not title or prose is None:
            continue
        sentence = prose.split(". ")[0].rstrip(".:") + "."
        answer = sentence if len(sentence) <= ANSWER_CHARS else sentence[:ANSWER_CHARS].rsplit(" ", 1)[0] + " ..."
        rows += [{"messages": [{"role": "user", "content": question.format(title)},
                               {"role": "assistant", "content": answer}]} for question in QUESTIONS]
    return rows


def chat_directory(directory: Path, seq_length: int) -> Path:
    """Where the chat set for rows of ``seq_length`` tokens is kept (beside the corpus)."""
    return directory / f"chat-s{seq_length}"


def prepare_chat(directory: Path, seq_length: int) -> str:
    """Make (once) the corpus and the chat set's dataset beside it; return the chat set's prefix."""
    prepare(directory)
    chat = chat_directory(directory, seq_length)
    prefix = chat_output_prefixes(str(chat / "pydoc_chat"), "messages")["tokens"]
    if Path(prefix + ".idx").is_file():
        return prefix
    # start-up cost: pydoc's topics load only when the chat set is first built
    from pydoc_data.topics import topics

    staging = Path(tempfile.mkdtemp(prefix="chat.", dir=directory))
    try:
        print(f" preparing the embedded chat set (pydoc topics) in {chat} ...", flush=True)
        with open(staging / "chat.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in conversations(topics))
        (staging / "chat_template.jinja").write_text(TEMPLATE)
        result = preprocess(PreprocessConfig(
            inputs=[str(staging / "chat.jsonl")], output_prefix=str(staging / "pydoc_chat"),
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_options=TokenizerOptions(tokenizer_model=str(directory / "tokenizer.json")),
            json_keys=("messages",), chat=True, chat_template=str(staging / "chat_template.jinja"),
            seq_length=seq_length, skip_bad_lines=True, workers=1, progress=False))
        if result.bad_rows:  # said, not dropped silently
            print(f" {result.bad_rows} conversations longer than --seq-length {seq_length} were left out", flush=True)
        os.replace(staging, chat)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return prefix


def pydoc_chat_datasets(request: DatasetRequest) -> TrainingData:
    """The registered ``pydoc-chat`` dataset: SFT samples of the chat set, with the corpus's tokenizer."""
    return corpus_datasets(request, lambda directory: prepare_chat(directory, request.seq_length), sft_datasets)
