"""Turning a batch of input rows into token arrays, the work ``mega preprocess`` parallelises.

One :class:`DocumentEncoder` lives in each worker process. It parses JSON Lines itself (so the
main process only moves bytes), validates every row, optionally splits sentences, tokenizes the
whole batch in one call and lays the result out exactly as Megatron's ``preprocess_data.py``
does: one sequence per sentence (or per document), empty sequences dropped, and with
``--append-eod`` the end-of-document id appended to the last sequence of every non-empty document.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from mega.data.sentences import split_sentences
from mega.data.sources import LineBlock, RecordBlock


@dataclass(frozen=True)
class EncodingSettings:
    json_keys: tuple[str, ...] = ("text",)
    split_sentences: bool = False
    keep_newlines: bool = False
    append_eod: bool = False
    dtype: str = "int32"


@dataclass
class EncodedKey:
    """The documents of one JSON key: tokens back to back, and how they divide into sequences."""

    tokens: bytes
    sequence_lengths: np.ndarray  # int64, one per sequence
    sequences_per_document: np.ndarray  # int64, one per document


@dataclass
class EncodedBlock:
    path: str
    documents: int
    tokens: int
    progress_bytes: int | None
    unit: str = "line"  # what bad-row numbers count: JSON Lines lines, or rows of other formats
    keys: dict[str, EncodedKey] = field(default_factory=dict)
    bad_rows: list[tuple[int, str]] = field(default_factory=list)  # (line or row number, reason)


class DocumentEncoder:
    def __init__(self, tokenizer, settings: EncodingSettings):
        self.tokenizer = tokenizer
        self.settings = settings
        self.dtype = np.dtype(settings.dtype)

    def encode(self, block: LineBlock | RecordBlock) -> EncodedBlock:
        keys = self.settings.json_keys
        values: dict[str, list] = {key: [] for key in keys}
        numbers: list[int] = []  # the line (row) number of every valid document
        bad: list[tuple[int, str]] = []
        for number, row in self._rows(block, bad):
            texts = []
            for key in keys:
                text, problem = _check_value(row, key)
                if problem:
                    bad.append((number, problem))
                    break
                texts.append(text)
            else:
                numbers.append(number)
                for key, text in zip(keys, texts, strict=True):
                    values[key].append(text)
        try:
            encoded_keys = {key: self._encode_documents(values[key]) for key in keys}
        except Exception:
            # Some text the tokenizer rejects (NullTokenizer given words, say): find it, drop it.
            failing = self._failing_documents(values, numbers, bad)
            for key in keys:
                values[key] = [v for i, v in enumerate(values[key]) if i not in failing]
            encoded_keys = {key: self._encode_documents(values[key]) for key in keys}
        bad.sort()
        unit = "row" if isinstance(block, RecordBlock) else "line"
        encoded = EncodedBlock(block.path, len(values[keys[0]]), 0, block.progress_bytes, unit, bad_rows=bad)
        encoded.keys = encoded_keys
        encoded.tokens = sum(len(k.tokens) for k in encoded_keys.values()) // self.dtype.itemsize
        return encoded

    def _failing_documents(self, values: dict[str, list], numbers: list[int], bad: list) -> set[int]:
        failing = set()
        for key, texts in values.items():
            for i, text in enumerate(texts):
                try:
                    self._encode_documents([text])
                except Exception as error:
                    if i not in failing:
                        failing.add(i)
                        bad.append((numbers[i], f"field {key!r} cannot be tokenized: {error}"))
        return failing

    def _rows(self, block: LineBlock | RecordBlock, bad: list):
        if isinstance(block, RecordBlock):
            columns = [block.columns[key] for key in self.settings.json_keys]
            for offset, row_values in enumerate(zip(*columns, strict=True)):
                yield block.first_line + offset, dict(zip(self.settings.json_keys, row_values, strict=True))
            return
        loads = json.loads
        for offset, line in enumerate(block.data.split(b"\n")):
            if not line.strip():
                continue  # blank lines (and the end of the block) are not documents
            try:
                row = loads(line)
            except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
                bad.append((block.first_line + offset, f"invalid JSON: {error}"))
                continue
            if not isinstance(row, dict):
                bad.append((block.first_line + offset, f"expected a JSON object, got {type(row).__name__}"))
                continue
            yield block.first_line + offset, row

    def _encode_documents(self, texts: list) -> EncodedKey:
        """Tokenize documents (strings, or lists of sentences) and apply Megatron's layout rules."""
        settings = self.settings
        if settings.split_sentences or any(isinstance(t, list) for t in texts):
            sequences, per_document = [], []
            for text in texts:
                # Megatron treats a list as a document already split into sentences.
                parts = text if isinstance(text, list) else (
                    split_sentences(text, settings.keep_newlines) if settings.split_sentences else [text]
                )
                sequences.extend(parts)
                per_document.append(len(parts))
            per_document = np.asarray(per_document, np.int64)
        else:
            sequences, per_document = texts, np.ones(len(texts), np.int64)
        tokens, lengths = self.tokenizer.tokenize_packed(sequences, self.dtype)
        return _megatron_layout(tokens, lengths, per_document, self.tokenizer.eod if settings.append_eod else None)


def _check_value(row: dict, key: str) -> tuple[str | list | None, str | None]:
    if key not in row:
        return None, f"no field {key!r} (fields: {', '.join(map(str, row)) or 'none'})"
    value = row[key]
    if isinstance(value, list):
        if not all(isinstance(v, str) for v in value):
            return None, f"field {key!r} is a list holding something other than strings"
        problem = next((p for p in map(_unencodable, value) if p), None)
    elif isinstance(value, str):
        problem = _unencodable(value)
    else:
        return None, f"field {key!r} is {'null' if value is None else type(value).__name__}, expected a string"
    return (None, f"field {key!r} {problem}") if problem else (value, None)


def _unencodable(text: str) -> str | None:
    """JSON can spell lone surrogates (\\ud800), which no tokenizer can encode as UTF-8."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"holds an unpaired surrogate {text[error.start]!r} at character {error.start}"
    return None


def _megatron_layout(tokens: np.ndarray, lengths: np.ndarray, per_document: np.ndarray, eod: int | None) -> EncodedKey:
    documents = per_document.size
    document_of_sequence = np.repeat(np.arange(documents), per_document)
    keep = lengths > 0  # Megatron drops sentences that encode to nothing
    lengths = lengths[keep]
    document_of_sequence = document_of_sequence[keep]
    per_document = np.bincount(document_of_sequence, minlength=documents).astype(np.int64)
    if eod is not None and lengths.size:
        # After the last token of every non-empty document, counted in its last sequence.
        document_tokens = np.bincount(document_of_sequence, weights=lengths, minlength=documents).astype(np.int64)
        non_empty = per_document > 0
        tokens = np.insert(tokens, np.cumsum(document_tokens)[non_empty], np.asarray(eod, tokens.dtype))
        lengths = lengths.copy()
        lengths[(np.cumsum(per_document) - 1)[non_empty]] += 1
    return EncodedKey(np.ascontiguousarray(tokens).tobytes(), lengths.astype(np.int64), per_document)
