"""SentencePiece tokenizers from ``--tokenizer-model`` (a .model file), with Megatron-LM's three
flavours:

* ``SentencePieceTokenizer``: the model's pieces plus Megatron's special tokens ``<CLS>``,
  ``<SEP>``, ``<EOD>``, ``<MASK>`` (and ``<PAD>``/``<BOS>``/``<EOS>`` where the model lacks them),
  appended after the model's vocabulary when it does not have them; special tokens written in the
  text are encoded as their ids. ``eod`` is ``<EOD>``.
* ``GPTSentencePieceTokenizer``: the plain model; ``eod`` is the model's EOS.
* ``Llama2Tokenizer``: the plain model with BOS prepended to every text; ``eod`` is EOS.
"""

from __future__ import annotations

from collections.abc import Sequence

from mega.data.tokenizers.base import BaseTokenizer, TokenizerError, require_file


def _load(model_file: str | None, name: str):
    # start-up cost: a tokenizer's library loads only when that tokenizer is built
    import sentencepiece

    model_file = require_file(model_file, "--tokenizer-model", name, "a SentencePiece .model file")
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(model_file)
    except (OSError, RuntimeError) as error:
        raise TokenizerError(f"--tokenizer-model {model_file}: not a SentencePiece model ({error})") from None
    return processor


def _optional_id(value: int) -> int | None:
    return value if value >= 0 else None


class GPTSentencePieceTokenizer(BaseTokenizer):
    name = "GPTSentencePieceTokenizer"

    def __init__(self, tokenizer_model: str | None):
        self.processor = _load(tokenizer_model, self.name)
        self.pad = _optional_id(self.processor.pad_id())
        self.bos = _optional_id(self.processor.bos_id())
        eos = _optional_id(self.processor.eos_id())
        if eos is None:
            raise TokenizerError(f"--tokenizer-model {tokenizer_model}: the model has no EOS piece to end documents with")
        self._eod = eos

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.processor.encode(list(texts))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.processor.decode(list(ids))


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    name = "Llama2Tokenizer"

    def __init__(self, tokenizer_model: str | None):
        super().__init__(tokenizer_model)
        if self.bos is None:
            raise TokenizerError(f"--tokenizer-model {tokenizer_model}: Llama2Tokenizer needs a model with a BOS piece")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *self.processor.encode(text)]

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [[self.bos, *ids] for ids in self.processor.encode(list(texts))]


class SentencePieceTokenizer(BaseTokenizer):
    name = "SentencePieceTokenizer"

    def __init__(self, tokenizer_model: str | None):
        self.processor = _load(tokenizer_model, self.name)
        processor = self.processor
        self._vocab = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
        self.special_tokens: dict[str, int] = {}

        def add_special(token: str) -> int:
            if token not in self._vocab:
                self._vocab[token] = len(self._vocab)
            self.special_tokens[token] = self._vocab[token]
            return self._vocab[token]

        def model_piece(piece_id: int, fallback: str) -> str:
            return processor.id_to_piece(piece_id) if 0 <= piece_id < processor.get_piece_size() else fallback

        self.cls = add_special("<CLS>")
        self.sep = add_special("<SEP>")
        self._eod = add_special("<EOD>")
        self.mask = add_special("<MASK>")
        self.pad = add_special(model_piece(processor.pad_id(), "<PAD>"))
        self.bos = add_special(model_piece(processor.bos_id(), "<BOS>"))
        self.eos = add_special(model_piece(processor.eos_id(), "<EOS>"))
        self._special_by_id = {i: t for t, i in self.special_tokens.items()}

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        """Encode, emitting written special tokens (e.g. ``<EOD>``) as their ids."""
        ids: list[int] = []
        start = 0
        while True:
            # The earliest special token; at a tie, the one registered first (as Megatron-LM does).
            found = [(at, t) for t in self.special_tokens if (at := text.find(t, start)) >= 0]
            if not found:
                break
            at, token = min(found, key=lambda item: item[0])
            ids += self.processor.encode(text[start:at])
            ids.append(self.special_tokens[token])
            start = at + len(token)
        ids += self.processor.encode(text[start:])
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode; special tokens are written out, each followed by a space, as Megatron-LM does."""
        ids = list(ids)
        text, last = "", 0
        for position, token_id in enumerate(ids):
            if token_id in self._special_by_id:
                text += self.processor.decode(ids[last:position]) + " " + self._special_by_id[token_id] + " "
                last = position + 1
        return text + self.processor.decode(ids[last:])
