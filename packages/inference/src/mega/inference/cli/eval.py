"""``mega eval``: Megatron's zero-shot tasks on a mega checkpoint or a Hugging Face directory.

``--task wikitext-ppl`` (Megatron's WIKITEXT103: token- and word-level perplexity over
overlapping windows of a local text file, or the ``text`` fields of a jsonl file) and
``--task lambada`` (last-word accuracy over a local jsonl of ``{"text": ...}`` passages,
``--strict-lambada`` for Megatron's strict variant). Prints one JSON object. Under ``torchrun
--nproc-per-node N`` the model is tensor-parallel over the N ranks; rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mega.core.cli.argparser import CommandParser
from mega.inference.cli.load_arguments import add_load_arguments, existing_path

TASKS = ("wikitext-ppl", "lambada")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="mega eval",
        description="Evaluate a mega checkpoint or a Hugging Face model directory on Megatron's zero-shot tasks "
                    "and print the result as JSON: wikitext-ppl (perplexity over overlapping windows) or lambada "
                    "(last-word accuracy).",
    )
    add_load_arguments(parser)
    group = parser.add_argument_group("task")
    group.add_argument("--task", required=True, choices=TASKS, help="the evaluation")
    group.add_argument("--valid-data", required=True, metavar="PATH", type=existing_path,
                       help="wikitext-ppl: a text file (or jsonl with a 'text' field per line); "
                            "lambada: jsonl with a 'text' field per passage")
    group.add_argument("--seq-length", type=int, default=None,
                       help="window length in tokens (default: the model's positions)")
    group.add_argument("--overlapping-eval", type=int, default=None, metavar="N",
                       help="wikitext-ppl: windows start every N tokens and score their last N labels "
                            "(default: --seq-length, no overlap)")
    group.add_argument("--strict-lambada", action="store_true",
                       help="lambada: the last whitespace-separated word, not the last token")
    group.add_argument("--micro-batch-size", type=int, default=8, help="windows per forward (default 8)")
    parser.add_argument("--json", action="store_true",
                        help="the result is printed as JSON with or without it (as every report command takes --json)")
    return parser


def read_texts(path: str) -> list[str]:
    """The ``text`` field of every line of a jsonl file, or the whole of any other file."""
    content = Path(path).read_text(encoding="utf-8")
    if not path.endswith((".jsonl", ".json")):
        return [content]
    texts = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ValueError(f"--valid-data {path}: line {number} is not JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"--valid-data {path}: line {number} has no string field 'text'")
        texts.append(record["text"])
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("seq_length", "overlapping_eval", "micro_batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be positive, got {value}")  # exit 2, as argparse's
    try:
        texts = read_texts(args.valid_data)
    except ValueError as error:
        raise SystemExit(f"mega eval: error: {error}") from None

    # start-up cost: `mega --help` and the parser stay free of torch and the models
    from mega.inference.cli.engine_setup import load_on_ranks
    from mega.inference.eval_tasks import lambada_accuracy, perplexity

    loaded, groups = load_on_ranks(args, "eval")
    if loaded.tokenizer is None:
        raise SystemExit("mega eval: error: the checkpoint names no tokenizer: give --tokenizer-type (and its files)")
    seq_length = args.seq_length or loaded.max_positions
    if seq_length > loaded.max_positions:  # a flag the model cannot take: exit 2, as `mega generate --max-tokens`
        print(f"mega eval: error: --seq-length {seq_length} exceeds the model's {loaded.max_positions} positions",
              file=sys.stderr)
        return 2
    device = next(loaded.model.parameters()).device
    tp = groups.tp if groups.tp.size > 1 else None
    try:
        if args.task == "wikitext-ppl":
            if args.overlapping_eval is not None and args.overlapping_eval > seq_length:
                raise ValueError(f"--overlapping-eval {args.overlapping_eval} exceeds --seq-length {seq_length}")
            result = perplexity(loaded.model, loaded.tokenizer, "\n".join(texts), seq_length, args.overlapping_eval,
                                device, tp, args.micro_batch_size)
        else:
            result = lambada_accuracy(loaded.model, loaded.tokenizer, texts, args.strict_lambada,
                                      loaded.config.vocab_size, seq_length, device, tp)
    except ValueError as error:
        print(f"mega eval: error: {error}", file=sys.stderr)
        return 2
    if groups.tp.rank == 0:
        print(json.dumps({**result, "model": loaded.name}), flush=True)
    return 0
