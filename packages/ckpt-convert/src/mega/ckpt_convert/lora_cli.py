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
        if args.action == "import-peft":
            message = import_peft(args.load, args.adapter, args.save)
        elif args.action == "export-peft":
            message = export_peft(args.load, args.output, args.base_model, args.lora_dropout)
        else:
            message = merge(args.load, args.load_adapter, args.save)
    except LORA_ERRORS as error:
        print(f"mega lora: error: {error}", file=sys.stderr)
        return 1
    print(f"mega lora: {message}")
    return 0


LORA_ERRORS = (CheckpointError, ValueError, KeyError, OSError)  # what the actions below raise on bad input


def _family_and_config(metadata, purpose: str):
    family = get_plugins().models.get(metadata.model_family)
    if family.hf_mapping is None:
        raise ValueError(f"the {family.name} family has no Hugging Face counterpart to {purpose}")
    return family, family.config_class(**metadata.model_config)


def import_peft(load: str, adapter_dir: str, save: str) -> str:
    """Fold the PEFT adapter ``adapter_dir`` into the mega base checkpoint ``load``, written to ``save``
    (``mega lora import-peft``, ``mega convert --from hf-peft``)."""
    directory, metadata = checkpoint_and_metadata(load)
    family, config = _family_and_config(metadata, "take adapters of")
    adapter_config, adapter = read_peft_adapter(adapter_dir)
    merged = fold_peft_adapter(family.hf_mapping, config, checkpoint_tensors(load), adapter_config, adapter)
    write_release(save, directory, metadata, merged)
    return f"folded {len(adapter) // 2} adapted modules of {adapter_dir} into {save}"


def export_peft(load: str, output: str, base_model: str | None = None, dropout: float = 0.0) -> str:
    """The adapters of the LoRA checkpoint ``load`` as a PEFT adapter directory ``output``
    (``mega lora export-peft``, ``mega convert --to hf-peft``)."""
    _, metadata = checkpoint_and_metadata(load)
    tensors = _with_adapters(checkpoint_tensors(load), load)
    family, config = _family_and_config(metadata, "adapt")
    modules = write_peft_adapter(output, family.hf_mapping, config, tensors, dropout, base_model)
    return f"wrote a PEFT adapter of {len(modules)} modules to {output}"


def merge(load: str, load_adapter: str, save: str) -> str:
    """The base checkpoint ``load`` with the adapters of the LoRA checkpoint ``load_adapter`` folded in."""
    directory, metadata = checkpoint_and_metadata(load)
    adapters = {name: t for name, t in checkpoint_tensors(load_adapter).items() if ADAPTER in name}
    tensors = {**{name: t for name, t in checkpoint_tensors(load).items() if ADAPTER not in name}, **adapters}
    merged = merged_tensors(_with_adapters(tensors, load_adapter))
    write_release(save, directory, metadata, merged)
    return f"merged the adapters of {load_adapter} ({len(tensors) - len(merged)} tensors) into {save}"


def _with_adapters(tensors: dict, source: str) -> dict:
    if not any(ADAPTER in name for name in tensors):
        raise ValueError(f"{source} holds no LoRA adapters (train with --lora-rank)")
    return tensors


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
