"""``mega checkpoint info DIR``: what a checkpoint holds, and whether it is complete."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mega.core.checkpoint.adapter_record import locate_base
from mega.core.checkpoint.directory import checkpoint_and_metadata, read_tracker, saved_iterations
from mega.core.checkpoint.foreign import foreign_format
from mega.core.checkpoint.layout_text import layout_text
from mega.core.checkpoint.metadata import CheckpointError
from mega.core.checkpoint.space import human_size
from mega.core.cli.argparser import CommandParser

LAYOUT_KEYS = ("tp", "pp", "dp", "cp", "ep", "vpp", "world_size", "sequence_parallel", "distributed_optimizer",
               "data_parallel_strategy", "data_parallel_replicas")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="mega checkpoint info",
        description="Show a checkpoint's iteration, the layout it was saved at, its model family and "
                    "config, parameter count, size on disk and completeness; for a LoRA run's checkpoint, the "
                    "adapters' rank, alpha, targets and trainable parameters, and their base (found and unchanged "
                    "or not). DIR is a --save directory (its latest checkpoint) or one checkpoint in it (e.g. "
                    "DIR/iter_0000500).",
    )
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument("--json", action="store_true",
                        help="print the metadata as JSON (another format's checkpoint: its format and description)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        path, metadata = checkpoint_and_metadata(args.directory)  # checks completeness
    except CheckpointError as error:
        return _describe_foreign(args.directory, error, args.json)
    if args.json:
        print(metadata.to_json())
        return 0
    layout = metadata.layout
    config = ", ".join(f"{k}={v}" for k, v in sorted(metadata.model_config.items()) if v is not None)
    tokenizer = metadata.tokenizer["type"] if metadata.tokenizer else "none recorded"
    lines = [
        f"checkpoint:       {path}",
        "complete:         yes (every listed file present at its recorded size and checksum)",
        f"iteration:        {metadata.iteration}" + (" (release: weights only)" if path.name == "release" else ""),
        f"consumed samples: {metadata.consumed_samples}",
        "saved at layout:  " + ", ".join(f"{k}={layout[k]}" for k in LAYOUT_KEYS if k in layout),
        f"saved by:         {layout_text(layout)}",
        f"model family:     {metadata.model_family}",
        f"parameters:       {metadata.num_parameters:,}" + (" (the base model's)" if metadata.adapter else ""),
        f"size on disk:     {human_size(sum(metadata.files.values()))} in {len(metadata.files)} files",
        f"optimizer state:  {'yes (' + ', '.join(metadata.optimizer['state_keys']) + ')' if metadata.optimizer else 'no'}",
        f"tokenizer:        {tokenizer}",
        f"mega version:     {metadata.mega_version or 'unknown'}",
        f"model config:     {config}",
    ]
    if metadata.adapter:
        lines += adapter_lines(metadata.adapter, path)
    save_dir = path.parent
    if read_tracker(save_dir) is not None:
        others = [str(i) for i, _ in saved_iterations(save_dir)]
        lines.append(f"in {save_dir}:  iterations {', '.join(others) or 'none'}; tracker -> {read_tracker(save_dir)}")
    print("\n".join(lines))
    return 0


def adapter_lines(adapter: dict, path: Path) -> list[str]:
    """What a checkpoint of adapters alone holds, and whether the base it names is there."""
    settings = ", ".join(f"{key}={adapter[key]}" for key in ("rank", "alpha", "dropout") if key in adapter)
    base = adapter.get("base") or {}
    base_dir, found = locate_base(adapter)
    fingerprint = base.get("fingerprint") or "none recorded"
    lines = [
        f"adapter:          {adapter.get('method', 'adapter').upper()} {settings}",
        f"adapter targets:  {', '.join(adapter.get('targets', [])) or 'none recorded'}",
        f"trainable params: {adapter.get('trainable_parameters', 0):,} (the adapters: all this checkpoint's weights)",
        f"base:             {found}",
        f"base iteration:   {base.get('iteration')}; weights fingerprint {fingerprint}",
    ]
    if base_dir is not None:
        lines.append(f"use:              mega generate --load {path} (or --load {base['path']} --adapter {path})")
    else:
        lines.append(f"use:              mega generate --load BASE --adapter {path} (BASE: the model it was trained on)")
    return lines


def _describe_foreign(directory: str, error: CheckpointError, as_json: bool) -> int:
    """A checkpoint of another format a plugin recognises (a Megatron-LM save directory)."""
    checkpoint_format = foreign_format(directory, capability="describe")
    if checkpoint_format is None:
        print(f"mega checkpoint info: {error}", file=sys.stderr)
        return 1
    try:
        lines = checkpoint_format.describe(Path(directory))
        if as_json:
            name = getattr(checkpoint_format, "name", type(checkpoint_format).__name__)
            print(json.dumps({"checkpoint": directory, "format": name, "description": lines}, indent=2))
        else:
            print("\n".join(lines))
    except CheckpointError as foreign_error:
        print(f"mega checkpoint info: {foreign_error}", file=sys.stderr)
        return 1
    return 0
