"""The embedded default corpus: the text of Python's pydoc topics, tokenized on first use.

Every Python ships ``pydoc_data.topics`` (~465 kB of English, one document per help topic), so
`mega train` with no arguments has real text to learn from without a download. On first use
rank 0 trains a small byte-level BPE tokenizer on it and writes a Megatron ``.bin/.idx`` dataset
into the cache directory (``$MEGA_CACHE_DIR``, else ``~/.cache/mega``); the directory appears
complete or not at all (written aside, then renamed), so an interrupted first run simply redoes it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

from mega.core.datasets import DatasetRequest, TrainingData
from mega.core.tokenizer import TokenizerOptions, TokenizerSpec
from mega.data.distributed import current_rank_context
from mega.data.preprocess import PreprocessConfig, output_prefixes, preprocess
from mega.data.training_data import gpt_datasets

NAME = "pydoc-topics"
VOCAB_SIZE = 384
END_OF_DOCUMENT = "<|endoftext|>"
# Bump when the preparation changes, so old caches are not reused.
VERSION = 1


def cache_directory() -> Path:
    root = os.environ.get("MEGA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mega")
    return Path(root) / f"{NAME}-v{VERSION}-bpe{VOCAB_SIZE}"


def _write_corpus(path: Path) -> None:
    # start-up cost: tokenizers and pydoc's topics load only when the corpus is first built
    from pydoc_data.topics import topics

    with open(path, "w", encoding="utf-8") as handle:
        for name in sorted(topics):
            handle.write(json.dumps({"text": topics[name]}) + "\n")


def _train_tokenizer(corpus: Path, path: Path) -> None:
    # start-up cost, as above
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[END_OF_DOCUMENT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = (json.loads(line)["text"] for line in open(corpus, encoding="utf-8"))
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(path))


def prepare(directory: Path) -> Path:
    """Make (once) the tokenizer and the dataset in ``directory``; return the dataset prefix."""
    prefix = directory / output_prefixes("pydoc", ("text",), False)["text"]
    if (directory / "tokenizer.json").is_file() and prefix.with_suffix(".idx").is_file():
        return prefix
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
    try:
        print(f" preparing the embedded corpus (pydoc topics) in {directory} ...", flush=True)
        _write_corpus(staging / "corpus.jsonl")
        _train_tokenizer(staging / "corpus.jsonl", staging / "tokenizer.json")
        preprocess(PreprocessConfig(
            inputs=[str(staging / "corpus.jsonl")], output_prefix=str(staging / "pydoc"),
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_options=TokenizerOptions(tokenizer_model=str(staging / "tokenizer.json")),
            append_eod=True, workers=1, progress=False,
        ))
        os.replace(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return prefix


def pydoc_topics_datasets(request: DatasetRequest) -> TrainingData:
    """The registered ``pydoc-topics`` dataset: GPT samples of the corpus, with its tokenizer."""
    return corpus_datasets(request, prepare, gpt_datasets)


def corpus_datasets(request: DatasetRequest, make, builder) -> TrainingData:
    """``builder``'s splits of the dataset ``make(directory)`` prepares in the corpus's cache
    directory (made on rank 0 while the others wait; then it only names the prefix), with the
    corpus's tokenizer."""
    # start-up cost, as above
    from mega.data.tokenizers.huggingface import HuggingFaceTokenizer

    directory = cache_directory()
    context = current_rank_context()
    if context.rank == 0:
        make(directory)
    context.barrier()
    prefix = make(directory)
    spec = TokenizerSpec("HuggingFaceTokenizer", TokenizerOptions(tokenizer_model=str(directory / "tokenizer.json")))
    tokenizer = HuggingFaceTokenizer(spec.options.tokenizer_model)
    data = builder(dataclasses.replace(request, data_path=[str(prefix)], tokenizer=tokenizer))
    data.tokenizer, data.tokenizer_spec = tokenizer, spec
    return data
