"""``mega preprocess``: Megatron's ``tools/preprocess_data.py`` flags, mega's streaming pipeline."""

from __future__ import annotations

import argparse
import json
import os
import sys

from mega.core.cli.argparser import CommandParser
from mega.core.tokenizer import TokenizerOptions


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="mega preprocess",
        description=(
            "Tokenize documents into Megatron-compatible {prefix}_{key}_{document|sentence}.bin/.idx "
            "datasets. Input: JSON Lines (one document per line; .gz/.zst/.bz2/.xz too) or anything "
            "Hugging Face datasets reads locally (.json arrays, .parquet, .csv/.tsv, .arrow, .txt)."
        ),
    )
    group = parser.add_argument_group("input")
    group.add_argument("--input", nargs="+", required=True, metavar="PATH", help="input file(s), read in order")
    group.add_argument("--input-format", choices=["jsonl", "json", "parquet", "csv", "arrow", "text"],
                       help="format of every input (default: from each file name)")
    group.add_argument("--json-keys", nargs="+", default=None, metavar="KEY",
                       help="fields (columns) to tokenize, one output dataset each (default: text; "
                            "with --chat: messages)")
    group.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (rule-based, offline)")
    group.add_argument("--keep-newlines", action="store_true",
                       help="with --split-sentences, keep the whitespace and newlines after each sentence")
    group.add_argument("--lang", default="english", help="accepted for compatibility; the splitter is language-neutral")
    group.add_argument("--chat", action="store_true",
                       help="conversations ({\"messages\": [{role, content}...]} or prompt/response pairs, JSON Lines) "
                            "rendered by the chat template, with an assistant-only loss mask beside the tokens "
                            "({prefix}_messages_document and ..._loss_mask); --json-keys names the messages field")
    group.add_argument("--chat-template", metavar="FILE",
                       help="with --chat: a Jinja chat template (or a tokenizer_config.json holding one); "
                            "default: the tokenizer's own, beside its files")
    group.add_argument("--seq-length", type=int, metavar="N",
                       help="with --chat: a conversation of more than N tokens is a bad line")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip malformed lines (counted and reported) instead of failing on the first")

    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, help="e.g. GPT2BPETokenizer, HuggingFaceTokenizer, TikTokenizer")
    group.add_argument("--vocab-file", help="vocabulary (GPT-2 vocab.json, BERT vocab.txt)")
    group.add_argument("--merge-file", help="BPE merges (GPT-2 merges.txt)")
    group.add_argument("--tokenizer-model", help="SentencePiece .model, tokenizer.json (or its directory), .tiktoken")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer ids; TikTokenizer vocabulary cut")
    group.add_argument("--tiktoken-pattern", default="v2", help="TikTokenizer split pattern: v1, v2, cl100k or a regex")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="TikTokenizer ids reserved for special tokens (default 1000, as Megatron)")
    group.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document token")

    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True, help="path prefix of the output datasets")
    group.add_argument("--dataset-impl", choices=["mmap"], default="mmap", help=argparse.SUPPRESS)

    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=_cpu_count(), help="encoding processes (default: CPUs available)")
    group.add_argument("--partitions", type=int, default=1,
                       help="accepted for compatibility; mega streams the input and needs no partitions")
    group.add_argument("--log-interval", type=int, default=0, help=argparse.SUPPRESS)
    group.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                       help="progress line on stderr (auto: only on a terminal)")
    group.add_argument("--block-size", type=int, default=1 << 20, help=argparse.SUPPRESS)
    group.add_argument("--json", action="store_true",
                       help="print the summary as JSON: documents, tokens, seconds, outputs, bad_rows")
    return parser


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    # start-up cost: `mega --help` and the parser stay free of torch and the models
    from mega.core.plugins import PluginError
    from mega.data.chat_template import ChatTemplateError
    from mega.data.indexed_dataset import IndexedDatasetError
    from mega.data.preprocess import PreprocessConfig, preprocess
    from mega.data.sources import InputError
    from mega.data.tokenizers.base import TokenizerError

    if args.workers < 1:
        print(f"mega preprocess: error: --workers must be at least 1, got {args.workers}", file=sys.stderr)
        return 2
    if args.json_keys is None:
        args.json_keys = ["messages"] if args.chat else ["text"]
    if not args.chat and (args.chat_template or args.seq_length):
        print("mega preprocess: error: --chat-template and --seq-length need --chat", file=sys.stderr)
        return 2
    if args.chat and (args.split_sentences or len(args.json_keys) > 1):
        print("mega preprocess: error: --chat takes one --json-keys field and no --split-sentences", file=sys.stderr)
        return 2
    if args.keep_newlines and not args.split_sentences:
        print("mega preprocess: note: --keep-newlines only matters with --split-sentences", file=sys.stderr)
    config = PreprocessConfig(
        inputs=args.input,
        output_prefix=args.output_prefix,
        tokenizer_type=args.tokenizer_type,
        tokenizer_options=TokenizerOptions(args.vocab_file, args.merge_file, args.tokenizer_model, args.vocab_size),
        tokenizer_settings=(
            {"pattern": args.tiktoken_pattern, "num_special_tokens": args.tiktoken_num_special_tokens}
            if args.tokenizer_type == "TikTokenizer" else {}
        ),
        json_keys=tuple(args.json_keys),
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        append_eod=args.append_eod,
        workers=args.workers,
        input_format=args.input_format,
        skip_bad_lines=args.skip_bad_lines,
        block_bytes=args.block_size,
        progress={"auto": None, "always": True, "never": False}[args.progress],
        exit_on_signals=True,
        chat=args.chat,
        chat_template=args.chat_template,
        seq_length=args.seq_length,
    )
    try:
        result = preprocess(config)
    except (InputError, TokenizerError, IndexedDatasetError, PluginError, ChatTemplateError, OSError) as error:
        print(f"mega preprocess: error: {error}", file=sys.stderr)
        print("mega preprocess: no output was written", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mega preprocess: interrupted; no output was written", file=sys.stderr)
        return 130

    rate = result.tokens / result.seconds if result.seconds else 0.0
    if args.json:
        print(json.dumps({"documents": result.documents, "tokens": result.tokens, "seconds": result.seconds,
                          "outputs": result.outputs, "bad_rows": result.bad_rows,
                          "first_bad_rows": result.first_bad_rows}))
    else:
        print(f"mega preprocess: {result.documents:,} documents, {result.tokens:,} tokens in "
              f"{result.seconds:.1f} s ({rate / 1e6:.2f}M tokens/s)")
        for prefix in result.outputs.values():
            print(f"  {prefix}.bin / .idx")
    if result.bad_rows:
        print(f"mega preprocess: skipped {result.bad_rows:,} bad lines, the first:", file=sys.stderr)
        for line in result.first_bad_rows:
            print(f"  {line}", file=sys.stderr)
    return 0
