"""``mega preprocess``: text in, Megatron ``.bin/.idx`` datasets out, streaming and atomic.

The main process reads the input as bounded blocks (:mod:`mega.data.sources`), hands them to a
pool of workers that each own a tokenizer (:mod:`mega.data.document_encoder`), and writes the
results in input order through one :class:`IndexedDatasetWriter` per JSON key. At most
``2 * workers + 1`` blocks are in flight, so memory stays flat however big the input is; the
outputs appear only after the last block is written, and any failure (bad input, Ctrl-C,
SIGTERM) removes everything written so far.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from mega.core.tokenizer import TokenizerOptions
from mega.data.chat_encoder import build_chat_encoder, chat_output_prefixes
from mega.data.document_encoder import DocumentEncoder, EncodedBlock, EncodingSettings
from mega.data.indexed_dataset import IndexedDatasetWriter, dtype_for_vocab_size
from mega.data.progress import Progress
from mega.data.sources import InputError, detect_format, read_jsonl_blocks, read_records


@dataclass
class PreprocessConfig:
    inputs: list[str]
    output_prefix: str
    tokenizer_type: str
    tokenizer_options: TokenizerOptions = field(default_factory=TokenizerOptions)
    tokenizer_settings: dict = field(default_factory=dict)  # extra factory knobs (TikTokenizer)
    json_keys: tuple[str, ...] = ("text",)
    split_sentences: bool = False
    keep_newlines: bool = False
    append_eod: bool = False
    workers: int = 1
    input_format: str | None = None  # None: from each file's name
    skip_bad_lines: bool = False
    block_bytes: int = 1 << 20
    progress: bool | None = None  # None: only on a terminal
    # Command-line use: on Ctrl-C or SIGTERM, stop the workers, delete the partial output and
    # exit at once (the signal may land anywhere, even inside the pool's own locks).
    exit_on_signals: bool = False
    # --chat: conversations into tokens and an assistant loss mask (mega.data.chat_encoder).
    chat: bool = False
    chat_template: str | None = None  # a Jinja file; None: the tokenizer's own
    seq_length: int | None = None  # with chat: a longer conversation is a bad line


@dataclass
class PreprocessResult:
    outputs: dict[str, str]  # json key -> output prefix
    documents: int = 0
    tokens: int = 0
    bad_rows: int = 0
    first_bad_rows: list[str] = field(default_factory=list)  # "file:line: reason", a few
    seconds: float = 0.0


def output_prefixes(output_prefix: str, json_keys, split_sentences: bool) -> dict[str, str]:
    """Megatron's naming: ``{prefix}_{key}_{document|sentence}``."""
    level = "sentence" if split_sentences else "document"
    return {key: f"{output_prefix}_{key}_{level}" for key in json_keys}


# -- worker side ----------------------------------------------------------------------------------
_ENCODER: DocumentEncoder | None = None
_MAIN_PID: int | None = None  # of the process that starts the pool (the workers fork from it)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _build_encoder(config: PreprocessConfig, tokenizer=None) -> DocumentEncoder:
    if tokenizer is None:
        # start-up cost: loaded only on the path that needs it (a tokenizer; ctypes on Linux)
        from mega.data.tokenizers import build_tokenizer

        tokenizer = build_tokenizer(config.tokenizer_type, config.tokenizer_options, **config.tokenizer_settings)
    if config.chat:
        return build_chat_encoder(config, tokenizer)
    settings = EncodingSettings(
        json_keys=tuple(config.json_keys),
        split_sentences=config.split_sentences,
        keep_newlines=config.keep_newlines,
        append_eod=config.append_eod,
        dtype=dtype_for_vocab_size(tokenizer.vocab_size).str,
    )
    return DocumentEncoder(tokenizer, settings)


def _init_worker(config: PreprocessConfig) -> None:
    global _ENCODER
    # Ctrl-C goes to the main process, which then stops the pool: workers must not die first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The pool stops workers with SIGTERM; they must die at once, not run the main process's
    # handler (inherited through fork) and try to clean up.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_main_process()
    # Each worker is one core; a tokenizer library's own thread pool would oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if _ENCODER is None:  # with fork, the parent's encoder is inherited
        _ENCODER = _build_encoder(config)


def _die_with_main_process() -> None:
    """Linux: the kernel kills this worker when the main process dies. The main process kills the
    workers it knows of when interrupted, but the pool's own thread may be forking a replacement
    for a killed one at that moment; left alive, it would hold the main process's output pipes
    open forever. (A worker forked just before the main process died finds itself orphaned.)"""
    if not sys.platform.startswith("linux"):
        return
    # start-up cost, as above
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _MAIN_PID:
        os._exit(1)


def _encode(block) -> EncodedBlock:
    return _ENCODER.encode(block)


# -- main side ------------------------------------------------------------------------------------
def _blocks(config: PreprocessConfig) -> Iterator:
    for path in config.inputs:
        fmt = config.input_format or detect_format(path)
        if config.chat and fmt != "jsonl":
            raise InputError(f"{path}: --chat reads JSON Lines (one conversation per line), not {fmt}")
        if fmt == "jsonl":
            yield from read_jsonl_blocks(path, config.block_bytes)
        else:
            yield from read_records(path, fmt, list(config.json_keys))


def _ordered_map(pool, blocks: Iterator, in_flight: int) -> Iterator[EncodedBlock]:
    """``pool.imap`` in order, but never more than ``in_flight`` blocks ahead of the consumer
    (``imap`` itself reads its whole input as fast as it can, which is how Megatron runs out of RAM)."""
    pending: deque = deque()
    for block in blocks:
        pending.append(pool.apply_async(_encode, (block,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _pool_context():
    # fork shares the already-built tokenizer and starts instantly; elsewhere, spawn.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def preprocess(config: PreprocessConfig, tokenizer=None) -> PreprocessResult:
    """Run the pipeline; ``tokenizer`` (optional) replaces building one from the config (the
    workers share it when processes fork, and build their own from the config otherwise)."""
    global _ENCODER, _MAIN_PID
    if not config.inputs:
        raise InputError("no input files")
    for path in config.inputs:
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such file")
    if config.workers < 1:
        raise ValueError("--workers must be at least 1")
    encoder = _build_encoder(config, tokenizer)
    if config.chat:
        outputs = chat_output_prefixes(config.output_prefix, config.json_keys[0])
    else:
        outputs = output_prefixes(config.output_prefix, config.json_keys, config.split_sentences)
    result = PreprocessResult(outputs)
    start = time.monotonic()
    total_bytes = sum(os.path.getsize(p) for p in config.inputs)
    progress = Progress(total_bytes, config.progress)
    writers: dict[str, IndexedDatasetWriter] = {}
    pool = None
    previous_handlers = _exit_on_signals(writers) if config.exit_on_signals else {}
    try:
        for key, prefix in outputs.items():
            writers[key] = IndexedDatasetWriter(prefix, getattr(encoder, "output_dtypes", {}).get(
                key, encoder.settings.dtype))
        if config.workers == 1:
            encoded_blocks = map(encoder.encode, _blocks(config))
        else:
            _ENCODER, _MAIN_PID = encoder, os.getpid()
            pool = _pool_context().Pool(config.workers, _init_worker, (config,))
            encoded_blocks = _ordered_map(pool, _blocks(config), 2 * config.workers + 1)
        done_bytes, current_path = 0, None
        for encoded in encoded_blocks:
            _account_bad_rows(encoded, config, result)
            for key, part in encoded.keys.items():
                writers[key].add_documents(part.tokens, part.sequence_lengths, part.sequences_per_document)
            if encoded.path != current_path:
                if current_path is not None:
                    done_bytes += os.path.getsize(current_path)
                current_path = encoded.path
            result.documents += encoded.documents
            result.tokens += encoded.tokens
            position = None if encoded.progress_bytes is None else done_bytes + encoded.progress_bytes
            progress.update(encoded.documents, encoded.tokens, position)
        if result.tokens == 0:
            # (megatron-core cannot even open a dataset without tokens: it memory-maps the .bin)
            raise InputError(
                f"{', '.join(config.inputs)}: no tokens to write ({result.documents} documents"
                f"{f', {result.bad_rows} bad lines skipped' if result.bad_rows else ''})"
            )
        # Everything is written: first all indices, then all renames, so that a failure while
        # writing one key's index leaves no key's dataset behind.
        for writer in writers.values():
            writer.write_index()
        for writer in writers.values():
            writer.publish()
    except BaseException:
        if pool is not None:
            pool.terminate()
            pool.join()
            pool = None
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        _ENCODER = None
        progress.close()
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
    if pool is not None:
        pool.close()
        pool.join()
    result.seconds = time.monotonic() - start
    return result


def _account_bad_rows(encoded: EncodedBlock, config: PreprocessConfig, result: PreprocessResult) -> None:
    if not encoded.bad_rows:
        return

    def location(number: int) -> str:
        return f"{encoded.path}:{number}" if encoded.unit == "line" else f"{encoded.path}:row {number}"

    if not config.skip_bad_lines:
        number, reason = encoded.bad_rows[0]
        raise InputError(f"{location(number)}: {reason} (pass --skip-bad-lines to skip such lines)")
    result.bad_rows += len(encoded.bad_rows)
    for number, reason in encoded.bad_rows[: max(0, 5 - len(result.first_bad_rows))]:
        result.first_bad_rows.append(f"{location(number)}: {reason}")


def _exit_on_signals(writers: dict[str, IndexedDatasetWriter]) -> dict:
    """Install SIGINT/SIGTERM handlers that clean up and exit; returns the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame):
        # The workers are killed outright, just before this process exits: left alone, each one
        # finishing a block would find the result pipe closed and print a BrokenPipeError
        # traceback. (One may hold the pool's queue lock; no one will wait for it any more.)
        for writer in writers.values():
            writer.remove_files()
        for worker in multiprocessing.active_children():
            os.kill(worker.pid, signal.SIGKILL)
        name = signal.Signals(signum).name
        sys.stderr.write(f"\nmega preprocess: interrupted by {name}; no output was written\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    return {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}
