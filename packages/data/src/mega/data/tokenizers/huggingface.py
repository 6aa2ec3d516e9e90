"""``HuggingFaceTokenizer``: any `tokenizers` tokenizer, from a tokenizer.json or a directory.

Ids are those of ``tokenizer.encode(text, add_special_tokens=False)``, which is what Megatron's
HuggingFaceTokenizer produces (no BOS/EOS added). The end-of-document token is the ``eos_token``
of the directory's tokenizer_config.json / special_tokens_map.json when there is one, else the
first special token with a conventional end-of-text name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from mega.data.tokenizers.base import LibraryTokenizer, TokenizerError
from mega.data.tokenizers.piece_cache import WHITESPACE, PieceCache

_EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]", "<|im_end|>")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]", "<|startoftext|>")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>")


def _special_token_names(directory: str | None) -> dict[str, str]:
    """eos/bos/pad/... token strings from the configuration files next to tokenizer.json."""
    names: dict[str, str] = {}
    if not directory:
        return names
    for filename in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(directory, filename)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as stream:
                config = json.load(stream)
        except (OSError, ValueError) as error:
            raise TokenizerError(f"{path}: cannot be read ({error})") from None
        for key in ("eos_token", "bos_token", "pad_token", "cls_token", "sep_token", "mask_token"):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) and key not in names:
                names[key] = value
    return names


def _uses_piece_local_byte_level(tokenizer) -> bool:
    """True when the tokenizer is GPT-2-style byte-level BPE, for which PieceCache is exact."""
    config = json.loads(tokenizer.to_str())
    pre = config.get("pre_tokenizer") or {}
    if config.get("normalizer") is not None or pre.get("type") != "ByteLevel":
        return False
    if not pre.get("use_regex", True) or pre.get("add_prefix_space", False):
        return False
    for added in config.get("added_tokens", []):
        # An added token is matched before pre-tokenization: one holding whitespace, or one
        # that swallows the spaces around it, could straddle a cut.
        if added.get("lstrip") or added.get("rstrip") or WHITESPACE & set(added.get("content", "")):
            return False
    return True


class HuggingFaceTokenizer(LibraryTokenizer):
    def __init__(self, tokenizer_model: str | None):
        # start-up cost: a tokenizer's library loads only when that tokenizer is built
        from tokenizers import Tokenizer

        if not tokenizer_model:
            raise TokenizerError("HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json or its directory)")
        if os.path.isdir(tokenizer_model):
            directory, path = tokenizer_model, os.path.join(tokenizer_model, "tokenizer.json")
            if not os.path.isfile(path):
                raise TokenizerError(f"--tokenizer-model {tokenizer_model}: the directory has no tokenizer.json")
        elif os.path.isfile(tokenizer_model):
            directory, path = os.path.dirname(tokenizer_model), tokenizer_model
        else:
            raise TokenizerError(f"--tokenizer-model {tokenizer_model}: no such file or directory")
        try:
            self.reference = Tokenizer.from_file(path)
        except Exception as error:
            raise TokenizerError(f"--tokenizer-model {path}: not a tokenizers tokenizer.json ({error})") from None
        # A tokenizer.json may carry padding/truncation meant for model inputs (MiniLM pads to
        # 128); transformers ignores them unless asked, and so must we.
        self.reference.no_padding()
        self.reference.no_truncation()

        vocab = self.reference.get_vocab(with_added_tokens=True)
        names = _special_token_names(directory)

        def lookup(key: str, fallbacks: tuple[str, ...]) -> int | None:
            token = names.get(key)
            if token is not None and token in vocab:
                return vocab[token]
            return next((vocab[t] for t in fallbacks if t in vocab), None)

        eod = lookup("eos_token", _EOD_NAMES)
        if eod is None:
            raise TokenizerError(
                f"--tokenizer-model {path}: cannot tell the end-of-document token (no eos_token in "
                f"tokenizer_config.json and none of {', '.join(_EOD_NAMES)} in the vocabulary)"
            )
        self._eod = eod
        self.bos = lookup("bos_token", _BOS_NAMES)
        self.pad = lookup("pad_token", _PAD_NAMES)
        self.cls = lookup("cls_token", ())
        self.sep = lookup("sep_token", ())
        self.mask = lookup("mask_token", ())
        self._vocab_size = self.reference.get_vocab_size(with_added_tokens=True)
        self._piece_local = _uses_piece_local_byte_level(self.reference)
        self._caches: dict[np.dtype, PieceCache] = {}

    def tokenize_packed(self, texts: Sequence[str], dtype) -> tuple[np.ndarray, np.ndarray]:
        if not self._piece_local:
            return super().tokenize_packed(texts, dtype)
        dtype = np.dtype(dtype)
        cache = self._caches.get(dtype)
        if cache is None:
            cache = self._caches[dtype] = PieceCache(self.tokenize_batch, dtype)
        return cache.encode_packed(texts)
