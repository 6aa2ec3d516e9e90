"""Conversations into token ids and an assistant mask: the work ``mega preprocess --chat`` parallelises.

Each JSON Lines row is one conversation, ``{"messages": [{"role": ..., "content": ...}, ...]}``
(the field is ``--json-keys``' first, ``messages`` by default), or a prompt/response pair
(``{"prompt": ..., "response": ...}``, ``completion`` for ``response`` as TRL names it, and an
optional ``system``) taken as a user turn and an assistant turn. The chat template renders the
conversation (:mod:`mega.data.chat_template`); the text is tokenized whole, and a token is the
assistant's when it overlaps a character the assistant wrote, as ``transformers`` marks
``assistant_masks`` (a tokenizer without character offsets tokenizes each run of the text apart).

Every document goes to two datasets with the same layout: the token ids
(``{prefix}_messages_document``) and the mask, 1 for the assistant's tokens, 0 for the rest
(``{prefix}_messages_document_loss_mask``, uint8). A row that is not a conversation, a role the
template does not know, an empty assistant turn, a conversation without an assistant turn or, with
``--seq-length``, one longer than a training sequence is a bad line, named by file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from mega.data.chat_template import ChatTemplate, ChatTemplateError, find_chat_template, load_chat_template
from mega.data.document_encoder import EncodedBlock, EncodedKey
from mega.data.indexed_dataset import dtype_for_vocab_size
from mega.data.sources import LineBlock

LOSS_MASK_SUFFIX = "_loss_mask"


@dataclass(frozen=True)
class ChatSettings:
    messages_key: str = "messages"
    append_eod: bool = False
    max_tokens: int | None = None  # --seq-length: a longer conversation is a bad line
    dtype: str = "int32"


def chat_output_prefixes(output_prefix: str, messages_key: str) -> dict[str, str]:
    """The tokens' and the mask's dataset prefixes, by the keys :class:`ChatEncoder` fills."""
    tokens = f"{output_prefix}_{messages_key}_document"
    return {"tokens": tokens, "loss_mask": tokens + LOSS_MASK_SUFFIX}


class ChatEncoder:
    def __init__(self, tokenizer, template: ChatTemplate, settings: ChatSettings):
        self.tokenizer, self.template, self.settings = tokenizer, template, settings
        self.dtype = np.dtype(settings.dtype)
        self.output_dtypes = {"tokens": self.dtype, "loss_mask": np.dtype(np.uint8)}
        # A `tokenizers` tokenizer gives each token's characters; others tokenize the runs apart.
        reference = getattr(tokenizer, "reference", None)
        self._offsets = reference if type(reference).__module__.startswith("tokenizers") else None

    def encode(self, block: LineBlock) -> EncodedBlock:
        token_parts, mask_parts, bad = [], [], []
        for number, line in _lines(block):
            try:
                tokens, mask = self.encode_conversation(_conversation(line, self.settings.messages_key))
            except (ChatTemplateError, _BadConversation) as error:
                bad.append((number, str(error)))
                continue
            except Exception as error:  # text the tokenizer rejects (NullTokenizer given words, say)
                bad.append((number, f"the rendered conversation cannot be tokenized: {error}"))
                continue
            token_parts.append(tokens)
            mask_parts.append(mask)
        lengths = np.fromiter(map(len, token_parts), np.int64, len(token_parts))
        ones = np.ones(len(token_parts), np.int64)

        def key(parts, dtype):
            data = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
            return EncodedKey(data.tobytes(), lengths, ones)

        encoded = EncodedBlock(block.path, len(token_parts), int(lengths.sum()), block.progress_bytes, "line",
                               bad_rows=bad)
        encoded.keys = {"tokens": key(token_parts, self.dtype), "loss_mask": key(mask_parts, np.uint8)}
        return encoded

    def encode_conversation(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and the 0/1 assistant mask of one conversation."""
        known = self.template.roles
        for index, message in enumerate(messages):
            if message["role"] not in known:
                raise _BadConversation(f"message {index + 1} has role {message['role']!r}, which the chat template "
                                       f"does not know (it knows {', '.join(known)})")
        text, spans = self.template.assistant_spans(messages)
        if not spans:
            raise _BadConversation("the chat template marks no assistant tokens: nothing would be in the loss")
        ids, mask = self._tokenize(text, spans)
        if self.settings.append_eod:
            ids.append(self.tokenizer.eod)
            mask.append(1 if messages[-1]["role"] == "assistant" else 0)
        limit = self.settings.max_tokens
        if limit is not None and len(ids) > limit:
            raise _BadConversation(f"the conversation has {len(ids)} tokens, more than --seq-length {limit}")
        return np.asarray(ids, np.int64), np.asarray(mask, np.uint8)

    def _tokenize(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        if self._offsets is not None:
            encoding = self._offsets.encode(text, add_special_tokens=False)
            return list(encoding.ids), _overlap_mask(encoding.offsets, spans)
        ids, mask, cursor = [], [], 0
        for start, end in spans:  # each run of the text apart
            for piece, value in ((text[cursor:start], 0), (text[start:end], 1)):
                piece_ids = self.tokenizer.tokenize(piece) if piece else []
                ids += piece_ids
                mask += [value] * len(piece_ids)
            cursor = end
        tail = self.tokenizer.tokenize(text[cursor:]) if cursor < len(text) else []
        return ids + tail, mask + [0] * len(tail)


def _overlap_mask(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token overlapping a span (spans and offsets both in order)."""
    mask, span = [0] * len(offsets), 0
    for index, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[index] = 1
    return mask


class _BadConversation(ValueError):
    pass


def _lines(block: LineBlock):
    for offset, line in enumerate(block.data.split(b"\n")):
        if line.strip():
            yield block.first_line + offset, line


def _conversation(line: bytes, messages_key: str) -> list[dict]:
    """The messages of a row, checked: a list of {role, content} with string values."""
    try:
        row = json.loads(line)
    except ValueError as error:
        raise _BadConversation(f"invalid JSON: {error}") from None
    if not isinstance(row, dict):
        raise _BadConversation(f"expected a JSON object, got {type(row).__name__}")
    if messages_key in row:
        messages = row[messages_key]
    elif "prompt" in row and ("response" in row or "completion" in row):
        answer = row.get("response", row.get("completion"))
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": answer}]
        if "system" in row:
            messages.insert(0, {"role": "system", "content": row["system"]})
    else:
        raise _BadConversation(f"no field {messages_key!r} and no prompt/response pair "
                               f"(fields: {', '.join(map(str, row)) or 'none'})")
    if not isinstance(messages, list) or not messages:
        raise _BadConversation(f"field {messages_key!r} must be a non-empty list of messages")
    for index, message in enumerate(messages):
        where = f"message {index + 1}"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _BadConversation(f"{where} is not an object with a string 'role'")
        content = message.get("content")
        if not isinstance(content, str):
            raise _BadConversation(f"{where} ({message['role']}) has no string 'content'")
        if message["role"] == "assistant" and not content.strip():
            raise _BadConversation(f"{where} is an empty assistant turn")
    return messages


def build_chat_encoder(config, tokenizer) -> ChatEncoder:
    """The encoder of a ``PreprocessConfig`` with ``chat``: its template is ``--chat-template``, else
    the one beside the tokenizer's files."""
    options = config.tokenizer_options
    if config.chat_template:
        template = load_chat_template(config.chat_template)
    else:
        template = find_chat_template(options.tokenizer_model or options.vocab_file)
        if template is None:
            raise ChatTemplateError(
                f"--chat: the tokenizer ({config.tokenizer_type}) has no chat template beside its files "
                f"(tokenizer_config.json's chat_template or chat_template.jinja); give one with --chat-template FILE")
    settings = ChatSettings(messages_key=config.json_keys[0], append_eod=config.append_eod,
                            max_tokens=config.seq_length, dtype=dtype_for_vocab_size(tokenizer.vocab_size).str)
    return ChatEncoder(tokenizer, template, settings)
