"""BERT (masked-LM sentence pairs) and T5 (span corruption) samples, as megatron-core makes them.

For the same sentence-split ``.bin/.idx`` data, split, seed, lengths and tokenizer, item ``i``
equals item ``i`` of megatron-core's ``BERTMaskedWordPieceDataset`` / ``T5MaskedWordPieceDataset``:
the rows come from :func:`build_sentence_sample_index`, each sample's draws from
``numpy.random.RandomState(seed + i)`` in Megatron's order, the masks from :func:`mask_tokens`.

Samples are dicts of Megatron's fields:

* BERT: ``text`` ``[CLS] A [SEP] B [SEP]`` (masked, padded), ``types`` (0 for A, 1 for B),
  ``labels`` (the original token at masked positions, -1 elsewhere), ``loss_mask``,
  ``padding_mask`` (1 on tokens), ``is_random`` (A and B swapped: the sentence-order label),
  ``truncated``.
* T5: ``text_enc`` (masked spans replaced by one sentinel each), ``text_dec`` (``bos``, then
  each sentinel and its span), ``labels`` (``text_dec`` shifted left, ending in ``eos``),
  ``loss_mask``, ``enc_mask``/``dec_mask`` (1 on tokens), ``truncated``.
"""

from __future__ import annotations

import abc
import json
from collections import deque
from dataclasses import dataclass

import numpy as np

from mega.data.index_cache import IndexCache, description_hash, files_fingerprint
from mega.data.masked_lm import MaskingConfig, mask_tokens
from mega.data.sentence_samples import build_sentence_sample_index

# Megatron-LM's pretrain_bert.py / pretrain_t5.py masking settings.
BERT_MASKING = dict(max_ngram=3, whole_word=True, longer_ngrams_first=False, geometric=False)
T5_MASKING = dict(max_ngram=10, whole_word=True, longer_ngrams_first=False, geometric=True)


@dataclass(frozen=True)
class MaskedVocabulary:
    """The special ids and word-piece structure a masked sample needs from the tokenizer.

    ``continuation``: bool per id, True for ``##`` word pieces; ``lookup_size``: random
    replacements draw uniformly from ids ``0 .. lookup_size - 1`` (Megatron's ``inv_vocab``).
    """

    cls: int
    sep: int
    mask: int
    pad: int
    continuation: np.ndarray
    lookup_size: int
    bos: int | None = None
    eos: int | None = None
    sentinels: tuple[int, ...] = ()

    @classmethod
    def of(cls, tokenizer) -> MaskedVocabulary:
        """From a WordPiece tokenizer with ``cls``, ``sep``, ``mask``, ``pad`` and ``inv_vocab``
        (mega's BertWordPiece tokenizers; ``--vocab-extra-ids`` adds bos, eos and sentinels)."""
        missing = [name for name in ("cls", "sep", "mask", "pad") if getattr(tokenizer, name, None) is None]
        if missing or not hasattr(tokenizer, "inv_vocab"):
            raise ValueError(f"masked-LM samples need a WordPiece tokenizer with [CLS], [SEP], [MASK] and [PAD] "
                             f"(--tokenizer-type BertWordPieceLowerCase or BertWordPieceCase); "
                             f"{type(tokenizer).__name__} has no {', '.join(missing) or 'inv_vocab'}")
        inverse = tokenizer.inv_vocab
        continuation = np.zeros(len(inverse), dtype=bool)
        for token_id, token in inverse.items():
            continuation[token_id] = token.startswith("##")
        return cls(tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.pad, continuation, len(inverse),
                   getattr(tokenizer, "bos", None), getattr(tokenizer, "eos", None),
                   tuple(getattr(tokenizer, "additional_special_tokens_ids", ())))


@dataclass(frozen=True)
class MaskedDatasetConfig:
    sequence_length: int  # BERT's sample length; T5's encoder length
    random_seed: int = 1234
    masking_probability: float = 0.15
    short_sequence_probability: float = 0.1
    binary_head: bool = True  # BERT: sentence pairs with the sentence-order label
    decoder_sequence_length: int | None = None  # T5
    path_to_cache: str | None = None


class _MaskedDataset(abc.ABC):
    kind = ""
    reserved = 0  # special tokens added around the text
    masking: dict = {}

    def __init__(self, source, path: str | None, documents: np.ndarray, num_samples: int | None, split: str,
                 config: MaskedDatasetConfig, vocabulary: MaskedVocabulary, cache: IndexCache | None = None):
        self.source, self.path, self.split = source, path, split
        self.config, self.vocabulary = config, vocabulary
        self.masking_config = MaskingConfig(probability=config.masking_probability, **self.masking)
        max_length = config.sequence_length - self.reserved
        min_sentences = self.min_sentences
        self.description = description = json.dumps({
            "class": self.kind, "path": path, "files": files_fingerprint(path), "split": split,
            "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [0, 0],
            "num_samples": num_samples, "random_seed": config.random_seed, "max_length": max_length,
            "short_sequence_probability": config.short_sequence_probability, "min_sentences": min_sentences,
        }, indent=2)
        stem = f"{description_hash(description)}-{self.kind}-{split}"
        cached = cache.load(stem, ["sample_index"]) if cache is not None else None
        if cached is not None:
            self.sample_index = cached["sample_index"]
        else:
            if len(documents) == 0:
                raise ValueError(f"the {split} split of {path or 'the mock data'} has no documents; "
                                 f"change --split or the data")
            boundaries = source.document_indices[np.append(documents, documents[-1] + 1)]
            self.sample_index = build_sentence_sample_index(
                boundaries, source.sequence_lengths, num_samples, max_length, config.short_sequence_probability,
                config.random_seed, min_sentences)
            if cache is not None:
                cache.save(stem, description, {"sample_index": self.sample_index})

    min_sentences = 1

    def __len__(self) -> int:
        return self.sample_index.shape[0]

    def _sentences_and_rng(self, index: int):
        first, end, target = (int(v) for v in self.sample_index[index])
        sentences = [self.source.get(i).tolist() for i in range(first, end)]
        return sentences, target, np.random.RandomState(seed=(self.config.random_seed + index) % 2**32)

    def _mask(self, tokens: list[int], target: int, rng: np.random.RandomState):
        vocabulary = self.vocabulary
        special = (vocabulary.cls, vocabulary.sep)
        return mask_tokens(tokens, target, rng, config=self.masking_config,
                           is_special=lambda token: token in special,
                           continues_word=lambda token: bool(vocabulary.continuation[token]),
                           replacement=self._replacement)

    @abc.abstractmethod
    def _replacement(self, rng: np.random.RandomState) -> int | None:
        """What a masked token becomes (None: it stays)."""

    def _padded(self, tokens: list[int], length: int, value: int) -> np.ndarray:
        return np.pad(np.array(tokens, dtype=np.int64), (0, length - len(tokens)), constant_values=value)

    def __repr__(self) -> str:
        return f"{self.kind}({self.path!r}, split={self.split}, {len(self)} samples)"


class BERTDataset(_MaskedDataset):
    kind = "BERTMaskedWordPieceDataset"
    reserved = 3  # [CLS] A [SEP] B [SEP]
    masking = BERT_MASKING

    @property
    def min_sentences(self) -> int:
        return 2 if self.config.binary_head else 1

    def _replacement(self, rng):
        # 80% [MASK], 10% a random token of the vocabulary, 10% unchanged.
        if rng.random() < 0.8:
            return self.vocabulary.mask
        if rng.random() >= 0.5:
            return rng.randint(0, self.vocabulary.lookup_size)
        return None

    def __getitem__(self, index: int) -> dict:
        sentences, target, rng = self._sentences_and_rng(index)
        pivot, swapped = len(sentences), False
        if self.config.binary_head:
            pivot = rng.randint(low=1, high=len(sentences)) if len(sentences) >= 3 else 1
            swapped = rng.random() < 0.5
        first = [t for sentence in sentences[:pivot] for t in sentence]
        second = [t for sentence in sentences[pivot:] for t in sentence]
        if swapped:
            first, second = second, first
        truncated = len(first) + len(second) > target
        while len(first) + len(second) > target:  # trim the longer part at a random end
            longer = first if len(first) > len(second) else second
            del longer[0 if rng.random() < 0.5 else -1]
        v = self.vocabulary
        tokens = [v.cls, *first, v.sep]
        types = [0] * len(tokens)
        if second:
            tokens += [*second, v.sep]
            types += [1] * (len(second) + 1)
        masked = self._mask(tokens, target, rng)
        length = self.config.sequence_length
        text = self._padded(masked.tokens, length, v.pad)
        padding_mask = np.ones(length, dtype=np.int64)
        padding_mask[text == v.pad] = v.pad  # Megatron writes the pad id itself (0 for BERT vocabularies)
        labels = np.full(length, -1, dtype=np.int64)
        labels[masked.positions] = masked.labels
        loss_mask = np.zeros(length, dtype=np.int64)
        loss_mask[masked.positions] = 1
        text[text == v.pad] = 0
        labels[labels == v.pad] = 0
        return {"text": text, "types": self._padded(types, length, v.pad), "labels": labels,
                "is_random": int(swapped), "padding_mask": padding_mask, "loss_mask": loss_mask,
                "truncated": int(truncated)}


class T5Dataset(_MaskedDataset):
    kind = "T5MaskedWordPieceDataset"
    reserved = 2  # one bos and one eos
    masking = T5_MASKING

    def __init__(self, source, path, documents, num_samples, split, config: MaskedDatasetConfig,
                 vocabulary: MaskedVocabulary, cache: IndexCache | None = None):
        if vocabulary.bos is None or vocabulary.eos is None or not vocabulary.sentinels:
            raise ValueError("T5 samples need a tokenizer with [BOS], [EOS] and sentinel tokens: "
                             "give --vocab-extra-ids 100 (Megatron's pretrain_t5 setting)")
        if config.decoder_sequence_length is None:
            raise ValueError("T5 samples need the decoder length (--decoder-seq-length)")
        super().__init__(source, path, documents, num_samples, split, config, vocabulary, cache)

    def _replacement(self, rng):
        return self.vocabulary.mask

    def __getitem__(self, index: int) -> dict:
        sentences, target, rng = self._sentences_and_rng(index)
        tokens = [t for sentence in sentences for t in sentence]
        truncated = len(tokens) > target
        masked = self._mask(tokens[:target], target, rng)
        v = self.vocabulary
        sentinels = deque(v.sentinels)
        encoder, decoder_in, decoder_out, start = [], [v.bos], [], 0
        for positions, originals in masked.spans:
            sentinel = sentinels.popleft()
            encoder += [*masked.tokens[start:positions[0]], sentinel]
            decoder_in += [sentinel, *originals]
            decoder_out += [sentinel, *originals]
            start = positions[-1] + 1
        encoder += masked.tokens[start:]
        decoder_out.append(v.eos)
        encoder_length, decoder_length = self.config.sequence_length, self.config.decoder_sequence_length
        if len(decoder_in) > decoder_length:
            raise ValueError(f"a T5 sample's decoder side has {len(decoder_in)} tokens, more than "
                             f"--decoder-seq-length {decoder_length}: raise it or lower --mask-prob")
        text_enc = self._padded(encoder, encoder_length, v.pad)
        text_dec = self._padded(decoder_in, decoder_length, v.pad)
        enc_mask = (text_enc != v.pad).astype(np.int64)
        dec_mask = (text_dec != v.pad).astype(np.int64)
        labels = self._padded(decoder_out, decoder_length, -1)
        loss_mask = np.zeros(decoder_length, dtype=np.int64)
        loss_mask[:len(decoder_in)] = 1
        text_enc[text_enc == v.pad] = 0
        text_dec[text_dec == v.pad] = 0
        labels[labels == v.pad] = 0
        return {"text_enc": text_enc, "text_dec": text_dec, "labels": labels, "loss_mask": loss_mask,
                "truncated": int(truncated), "enc_mask": enc_mask, "dec_mask": dec_mask}
