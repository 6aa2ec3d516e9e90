"""Tokenizers by Megatron's ``--tokenizer-type`` names.

Each name maps to a factory (``make_*`` below, named apart from the modules they import) ``factory(options: TokenizerOptions, **settings) -> Tokenizer`` (the
form the ``register_tokenizers`` hook registers). Factories import their library only when
called, so listing tokenizers costs nothing. ``settings`` carries the few knobs that are not in
:class:`mega.core.tokenizer.TokenizerOptions` (TikTokenizer's pattern and special-token count).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mega.core.tokenizer import TokenizerOptions

if TYPE_CHECKING:  # this module stays import-light: `mega --help` reads TOKENIZER_TYPES
    from mega.data.tokenizers.base import BaseTokenizer


def make_gpt2_bpe(options: TokenizerOptions, **settings) -> BaseTokenizer:
    # start-up cost: a tokenizer's library loads only when that tokenizer is built
    from mega.data.tokenizers.gpt2_bpe import GPT2BPETokenizer

    return GPT2BPETokenizer(options.vocab_file, options.merge_file)


def make_huggingface(options: TokenizerOptions, **settings) -> BaseTokenizer:
    # start-up cost, as above
    from mega.data.tokenizers.huggingface import HuggingFaceTokenizer

    return HuggingFaceTokenizer(options.tokenizer_model)


def make_sentencepiece(options: TokenizerOptions, **settings) -> BaseTokenizer:
    # start-up cost, as above
    from mega.data.tokenizers.sentencepiece import SentencePieceTokenizer

    return SentencePieceTokenizer(options.tokenizer_model)


def make_gpt_sentencepiece(options: TokenizerOptions, **settings) -> BaseTokenizer:
    # start-up cost, as above
    from mega.data.tokenizers.sentencepiece import GPTSentencePieceTokenizer

    return GPTSentencePieceTokenizer(options.tokenizer_model)


def make_llama2(options: TokenizerOptions, **settings) -> BaseTokenizer:
    # start-up cost, as above
    from mega.data.tokenizers.sentencepiece import Llama2Tokenizer

    return Llama2Tokenizer(options.tokenizer_model)


def make_bert_lower_case(options: TokenizerOptions, **settings) -> BaseTokenizer:
    # start-up cost, as above
    from mega.data.tokenizers.bert_wordpiece import BertWordPieceLowerCase

    return BertWordPieceLowerCase(options.vocab_file, options.vocab_extra_ids)


def make_bert_case(options: TokenizerOptions, **settings) -> BaseTokenizer:
    # start-up cost, as above
    from mega.data.tokenizers.bert_wordpiece import BertWordPieceCase

    return BertWordPieceCase(options.vocab_file, options.vocab_extra_ids)


def make_tiktoken(options: TokenizerOptions, pattern: str = "v2", num_special_tokens: int = 1000, **settings) -> BaseTokenizer:
    # start-up cost, as above
    from mega.data.tokenizers.tiktoken_bpe import TikTokenizer

    return TikTokenizer(options.tokenizer_model, options.vocab_size, pattern, num_special_tokens)


def make_null(options: TokenizerOptions, **settings) -> BaseTokenizer:
    # start-up cost, as above
    from mega.data.tokenizers.null import NullTokenizer

    return NullTokenizer(options.vocab_size)


# name -> (factory import path, description): what plugin.py registers.
TOKENIZER_TYPES = {
    "GPT2BPETokenizer": ("make_gpt2_bpe", "GPT-2 byte-level BPE (--vocab-file, --merge-file)"),
    "HuggingFaceTokenizer": ("make_huggingface", "a tokenizers tokenizer.json or its directory (--tokenizer-model)"),
    "SentencePieceTokenizer": ("make_sentencepiece", "SentencePiece .model plus Megatron's <CLS> <SEP> <EOD> <MASK>"),
    "GPTSentencePieceTokenizer": ("make_gpt_sentencepiece", "SentencePiece .model, EOD = EOS"),
    "Llama2Tokenizer": ("make_llama2", "SentencePiece .model, BOS prepended, EOD = EOS"),
    "BertWordPieceLowerCase": ("make_bert_lower_case", "BERT WordPiece vocab.txt, lower-cased"),
    "BertWordPieceCase": ("make_bert_case", "BERT WordPiece vocab.txt, cased"),
    "TikTokenizer": ("make_tiktoken", "tiktoken BPE (.tiktoken or Megatron JSON) as Megatron builds it"),
    "NullTokenizer": ("make_null", "space-separated ids (--vocab-size)"),
}


def build_tokenizer(name: str, options: TokenizerOptions, plugins=None, **settings):
    """The tokenizer registered as ``name`` (by any installed plugin), built from ``options``."""
    # start-up cost, as above
    from mega.core.plugins import get_plugins

    plugins = get_plugins() if plugins is None else plugins
    factory = plugins.tokenizers.get(name)
    return factory(options, **settings)


__all__ = ["TOKENIZER_TYPES", "TokenizerOptions", "build_tokenizer"]
