"""``mega lora``: a LoRA run's checkpoint as a PEFT adapter directory, or merged into its base.

    mega lora export-peft --load LORA --output DIR [--base-model NAME]   # peft.PeftModel.from_pretrained
    mega lora merge --load BASE --load-adapter LORA --save OUT           # a plain mega checkpoint
    mega lora import-peft --load BASE --adapter DIR --save OUT           # a PEFT adapter folded into BASE

They read checkpoints' global tensors (any layout they were saved at); a LoRA run's checkpoint
holds the adapters alone, its base is the checkpoint the run loaded (``--load``). The merged checkpoint is a
``release`` (weights only) of the same family and config without adapters: ``mega train --load``,
``mega convert --to hf``, ``mega generate`` take it as any other. ``import-peft`` folds an adapter PEFT made for the
family's transformers model into a mega base checkpoint the same way (mega's fused layers hold one
adapter of one rank, PEFT's q/k/v and gate/up each their own, so the import merges).
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from mega.ckpt_convert.hf_peft import (
    ADAPTER,
    fold_peft_adapter,
    merged_tensors,
    read_peft_adapter,
    write_peft_adapter,
)
from mega.core.checkpoint.directory import checkpoint_and_metadata, resolve_checkpoint
from mega.core.checkpoint.metadata import CheckpointError
from mega.core.checkpoint.model_io import write_checkpoint
from mega.core.checkpoint.sharded_io import ShardedEntry, load_entries, read_index
from mega.core.checkpoint.tokenizer_files import TOKENIZER_DIR, tokenizer_spec
from mega.core.cli.argparser import CommandParser
from mega.core.parallel.pieces import Piece
from mega.core.plugins import get_plugins


def build_parser():
    parser = CommandParser(prog="mega lora", description="LoRA adapters of a mega checkpoint: export for "
                           "Hugging Face PEFT, or merge into the base weights")
    commands = parser.add_subparsers(dest="action", required=True)
    export = commands.add_parser("export-peft", help="write adapter_config.json + adapter_model.safetensors")
    export.add_argument("--load", required=True, help="a mega checkpoint of a LoRA run (--lora-rank)")
    export.add_argument("--output", required=True, help="the adapter directory to write")
    export.add_argument("--base-model", help="base_model_name_or_path recorded in adapter_config.json")
    export.add_argument("--lora-dropout", type=float, default=0.0, help="recorded in adapter_config.json")
    merge = commands.add_parser("merge", help="fold the adapters into the base weights: a plain checkpoint")
    merge.add_argument("--load", required=True, help="the base model's mega checkpoint (the LoRA run's --load)")
    merge.add_argument("--load-adapter", required=True, help="the LoRA run's checkpoint (its adapters)")
    merge.add_argument("--save", required=True, help="where to write the merged checkpoint")
    fold = commands.add_parser("import-peft", help="fold a PEFT LoRA adapter into a mega base checkpoint")
    fold.add_argument("--load", required=True, help="the base model as a mega checkpoint (mega convert --from hf)")
    fold.add_argument("--adapter", required=True, help="a PEFT adapter directory (adapter_config.json + safetensors)")
    fold.add_argument("--save", required=True, help="where to write the merged checkpoint")
    return parser


def checkpoint_tensors(path: str) -> dict:
    """Every global model tensor of a checkpoint, and its adapters' ``scaling`` buffers, by name."""
    directory = resolve_checkpoint(path)
    index = read_index(directory)
    wanted = {key: key.partition(".")[2] for key in index
              if key.startswith("model.") or (key.startswith("buffer.") and key.endswith(".adapter.scaling"))}
    tensors = {key: torch.empty(tuple(index[key].size), dtype=index[key].properties.dtype) for key in wanted}
    load_entries(directory, {key: ShardedEntry(tuple(t.shape), t.dtype, [Piece(t, (0,) * t.dim())])
                             for key, t in tensors.items()}, alone=True)
    return {name: tensors[key] for key, name in wanted.items()}


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)

    try:
        directory, metadata = checkpoint_and_metadata(args.load)
        family = get_plugins().models.get(metadata.model_family)
        tensors = checkpoint_tensors(args.load)
        if args.action == "import-peft":
            if family.hf_mapping is None:
                raise ValueError(f"the {family.name} family has no Hugging Face counterpart to take adapters of")
            adapter_config, adapter = read_peft_adapter(args.adapter)
            config = family.config_class(**metadata.model_config)
            merged = fold_peft_adapter(family.hf_mapping, config, tensors, adapter_config, adapter)
            write_release(args.save, directory, metadata, merged)
            print(f"mega lora: folded {len(adapter) // 2} adapted modules of {args.adapter} into {args.save}")
            return 0
        source = args.load
        if args.action == "merge":
            source = args.load_adapter
            adapters = {name: t for name, t in checkpoint_tensors(source).items() if ADAPTER in name}
            tensors = {**{name: t for name, t in tensors.items() if ADAPTER not in name}, **adapters}
        if not any(ADAPTER in name for name in tensors):
            raise ValueError(f"{source} holds no LoRA adapters (train with --lora-rank)")
        if args.action == "export-peft":
            if family.hf_mapping is None:
                raise ValueError(f"the {family.name} family has no Hugging Face counterpart to adapt")
            config = family.config_class(**metadata.model_config)
            modules = write_peft_adapter(args.output, family.hf_mapping, config, tensors, args.lora_dropout,
                                         args.base_model)
            print(f"mega lora: wrote a PEFT adapter of {len(modules)} modules to {args.output}")
            return 0
        merged = merged_tensors(tensors)
        write_release(args.save, directory, metadata, merged)
        print(f"mega lora: merged the adapters of {source} ({len(tensors) - len(merged)} tensors) into {args.save}")
        return 0
    except (CheckpointError, ValueError, KeyError, OSError) as error:
        print(f"mega lora: error: {error}", file=sys.stderr)
        return 1


def write_release(save: str, directory, metadata, tensors: dict) -> None:
    """``tensors`` as a release checkpoint of ``metadata``'s family and config, with the source
    checkpoint's tokenizer (said where it cannot be carried)."""
    tokenizer_dir = directory / TOKENIZER_DIR
    extra_files = sorted(tokenizer_dir.iterdir()) if tokenizer_dir.is_dir() else []
    release = dataclasses.replace(metadata, iteration=0, optimizer=None, grad_scaler=None, files={},
                                  checksums={}, consumed_samples=0, consumed_valid_samples=0)
    try:
        tokenizer = tokenizer_spec(directory, metadata)
    except CheckpointError as error:  # said, not dropped silently
        print(f"mega lora: note: the tokenizer is not carried over: {error}", file=sys.stderr)
        tokenizer, extra_files = None, []
    write_checkpoint(save, release, tensors, tokenizer, extra_files)
