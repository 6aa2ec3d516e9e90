"""``BertWordPieceLowerCase`` / ``BertWordPieceCase``: BERT WordPiece from ``--vocab-file`` (vocab.txt).

The reference is transformers' BertTokenizer (``do_lower_case`` as the name says); the
`tokenizers` BertWordPiece pipeline gives the same ids. ``cls``, ``sep``, ``mask`` and ``pad``
are the ``[CLS]``, ``[SEP]``, ``[MASK]``, ``[PAD]`` entries; ``eod`` is ``[SEP]``, the token BERT
puts at the end of a segment.

As Megatron-LM's BERT tokenizer, it appends ``[BOS]`` and ``[EOS]`` to the vocabulary (ids
``len(vocab.txt)`` and the next, unless the file has them) and, with ``--vocab-extra-ids N``, T5's
sentinels ``<extra_id_0>`` .. ``<extra_id_{N-1}>`` after them; ``inv_vocab`` maps every id to its
token (masked-LM data tells word pieces by their ``##``).
"""

from __future__ import annotations

from mega.data.tokenizers.base import LibraryTokenizer, TokenizerError, require_file


class BertWordPieceTokenizer(LibraryTokenizer):
    lower_case = True
    name = "BertWordPieceLowerCase"

    def __init__(self, vocab_file: str | None, vocab_extra_ids: int = 0):
        # start-up cost: a tokenizer's library loads only when that tokenizer is built
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

        vocab_file = require_file(vocab_file, "--vocab-file", self.name, "a BERT vocab.txt")
        try:
            with open(vocab_file, encoding="utf-8") as stream:
                vocab = {line.rstrip("\n"): i for i, line in enumerate(stream)}
        except UnicodeDecodeError as error:
            raise TokenizerError(f"--vocab-file {vocab_file}: not a UTF-8 vocab.txt ({error})") from None
        missing = [t for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]") if t not in vocab]
        if missing:
            raise TokenizerError(f"--vocab-file {vocab_file}: not a BERT vocabulary (no {', '.join(missing)})")
        tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
        tokenizer.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=self.lower_case
        )
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece(prefix="##")
        if vocab_extra_ids < 0:
            raise TokenizerError(f"--vocab-extra-ids must be >= 0, got {vocab_extra_ids}")
        sentinels = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in ("[BOS]", "[EOS]", *sentinels):
            vocab.setdefault(token, len(vocab))
        # Special tokens the vocabulary has get their own ids; the appended ones come in order after it.
        tokenizer.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[BOS]", "[EOS]", *sentinels])
        self.reference = tokenizer
        self._vocab_size = len(vocab)
        self.inv_vocab = {token_id: token for token, token_id in vocab.items()}
        self.cls, self.sep, self.mask, self.pad = (vocab[t] for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]"))
        self.bos, self.eos = vocab["[BOS]"], vocab["[EOS]"]
        self.additional_special_tokens_ids = [vocab[t] for t in sentinels]
        self._eod = self.sep


class BertWordPieceLowerCase(BertWordPieceTokenizer):
    lower_case = True
    name = "BertWordPieceLowerCase"


class BertWordPieceCase(BertWordPieceTokenizer):
    lower_case = False
    name = "BertWordPieceCase"
