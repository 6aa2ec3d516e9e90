"""``mega convert``: checkpoints between Hugging Face, mega and Megatron-LM, and between layouts."""

from __future__ import annotations

import argparse
import ctypes
import re
import sys
import time
from pathlib import Path

from mega.core.cli.argparser import CommandParser

DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}
FORMATS = ("hf", "mega", "megatron")
PEFT = "hf-peft"  # a LoRA adapter directory of Hugging Face PEFT: to and from mega's LoRA checkpoints
LAYOUT_OUTPUTS = ("mega", "megatron")  # formats whose output has a tp/pp layout


def byte_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB, 500MB or 2GiB")
    unit = (match.group(2) or "B").upper()
    scale = 1024 if "I" in unit else 1000
    return int(float(match.group(1)) * scale ** "BKMGT".index(unit[0]))


def give_freed_tensors_back() -> None:
    """Have glibc return every freed block of 1 MiB or more to the system at once.

    A conversion frees a tensor (1 to 50 MB for a 1B model's layers) for every one it makes.
    glibc serves blocks under its mmap threshold from its heap, and that threshold grows to
    32 MiB once a large block was freed, so the heap would keep the freed layers resident and
    the peak would grow with fragmentation rather than stay at one layer. A fixed 1 MiB
    threshold maps and unmaps each tensor. Other C libraries are left as they are.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold = -3  # glibc's malloc.h
    libc.mallopt(m_mmap_threshold, 1 << 20)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="mega convert",
        description=(
            "Convert a checkpoint between Hugging Face transformers directories (config.json, safetensors, "
            "tokenizer files), mega checkpoints and Megatron-LM save directories (legacy torch.save files or "
            "torch_dist), or reshard one to another tp/pp. "
            "Weights are converted a layer at a time, so memory stays near the largest tensors, not the "
            "model. The output appears only when complete."
        ),
        epilog="examples: mega convert --from hf --to mega --input ./Llama-3.2-1B --output ./ckpt "
               "--target-tensor-parallel-size 2;  mega convert --from megatron --to mega --input ./megatron-save "
               "--output ./ckpt;  mega convert --from mega --to megatron --megatron-format legacy --input ./ckpt "
               "--output ./megatron-save --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2;  "
               "mega convert --to hf-peft --input ./lora-ckpt --output ./adapter;  "
               "mega convert --from hf-peft --to mega --input ./adapter --base ./ckpt --output ./merged",
    )
    parser.add_argument("--from", dest="from_format", choices=(*FORMATS, PEFT),
                        help="format of --input (default: recognised from the directory)")
    parser.add_argument("--list-architectures", action="store_true",
                        help="print the Hugging Face architectures mega converts (each family's own, and the "
                             "Llama-like ones the generic bridge reads as the llama family) and exit")
    parser.add_argument("--to", dest="to_format", choices=(*FORMATS, PEFT),
                        help="format of --output. hf-peft: --input is a LoRA run's mega checkpoint (mega train "
                             "--lora-rank), --output a PEFT adapter directory (adapter_config.json + "
                             "adapter_model.safetensors) that peft.PeftModel.from_pretrained loads onto the base's "
                             "transformers model; --from hf-peft --to mega: --input is such a directory, folded into "
                             "the mega checkpoint --base (the merged model is written)")
    parser.add_argument("--input", metavar="DIR",
                        help="a Hugging Face model directory, a mega save directory or checkpoint, or a Megatron-LM "
                             "save directory (its latest_checkpointed_iteration.txt) or iter_* directory")
    parser.add_argument("--output", metavar="DIR", help="a new (or empty) directory")
    parser.add_argument("--model-family", metavar="NAME",
                        help="the registered model family (gpt, llama...) when config.json cannot tell it")
    parser.add_argument("--base", metavar="DIR",
                        help="--from hf-peft: the base model's mega checkpoint the adapter is folded into")
    parser.add_argument("--base-model", metavar="NAME",
                        help="--to hf-peft: base_model_name_or_path recorded in adapter_config.json")
    _add_layout_flags(parser)
    parser.add_argument("--with-initialised-heads", action="store_true",
                        help="hf output: also write the heads mega initialised when it read a Hugging Face directory "
                             "that lacked them (a bare BertModel's cls.*), as the full architecture "
                             "(BertForPreTraining); by default a converted model goes back as the architecture, tensor "
                             "names and buffers it came in with")
    parser.add_argument("--allow-unused-tensors", action="store_true",
                        help="convert a checkpoint holding tensors its model does not use (a Megatron-LM output layer "
                             "beside args that tie it to the embedding, say), leaving them out with a warning that "
                             "names them; without it they are an error")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="cast floating-point weights (default: keep each tensor's dtype)")
    parser.add_argument("--max-shard-size", type=byte_size, default="5GB", metavar="SIZE",
                        help="hf output: largest safetensors file before sharding with an index (default 5GB)")
    parser.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                        help="progress line on stderr (auto: only on a terminal)")
    return parser


def _add_layout_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the output's layout and of the optimizer state it carries."""
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1, metavar="TP",
                        help="mega and megatron outputs: tensor-parallel size the layout records and the "
                             "vocabulary is padded for (default 1); Megatron legacy files are split into this many "
                             "ranks")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=1, metavar="PP",
                        help="mega and megatron outputs: pipeline-parallel size the layout records (default 1); "
                             "Megatron legacy files are split into this many stages")
    parser.add_argument("--megatron-format", choices=["legacy", "torch_dist"],
                        help="megatron output: legacy (iter_*/mp_rank_TT[_PPP]/model_optim_rng.pt, one torch.save "
                             "per rank) or torch_dist (megatron-core dist_checkpointing; default)")
    parser.add_argument("--target-expert-parallel-size", type=int, default=1, metavar="EP",
                        help="mega output (MoE families): expert-parallel size the layout records; the "
                             "experts must split evenly over it (default 1; any ep loads the checkpoint)")
    parser.add_argument("--with-optimizer", action="store_true",
                        help="mega and megatron outputs: carry the optimizer state (Adam's exp_avg and exp_avg_sq "
                             "per parameter, fp32 main parameters when present, the step count) and the iteration, so "
                             "training resumes where it stopped; the input must be a mega checkpoint or a Megatron-LM "
                             "one (torch_dist or legacy files, regular or distributed optimizer) with its optimizer state")
    parser.add_argument("--megatron-optimizer", choices=["regular", "distributed"],
                        help="megatron torch_dist output with --with-optimizer: the optimizer of the Megatron-LM run "
                             "that loads it: regular (default) or distributed (--use-distributed-optimizer: its state "
                             "written fully_reshardable, which any tp/pp/dp loads)")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_architectures:
        return list_architectures()
    missing = [flag for flag, value in (("--to", args.to_format), ("--input", args.input), ("--output", args.output))
               if value is None]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    if PEFT in (args.from_format, args.to_format) or _is_peft_adapter(args):
        return convert_peft(parser, args)
    _check_output_flags(parser, args)

    # start-up cost: `mega convert --help` and argument errors answer without importing torch
    import torch

    # start-up cost: `mega --help` and the parser stay free of torch and the models
    from mega.ckpt_convert.conversion import convert
    from mega.ckpt_convert.errors import ConversionError
    from mega.ckpt_convert.formats import WriteOptions
    from mega.core.checkpoint import CheckpointError
    from mega.core.plugins import PluginError

    options = WriteOptions(
        tensor_parallel_size=args.target_tensor_parallel_size,
        pipeline_parallel_size=args.target_pipeline_parallel_size,
        expert_parallel_size=args.target_expert_parallel_size,
        max_shard_bytes=args.max_shard_size,
        progress={"auto": None, "always": True, "never": False}[args.progress],
        megatron_format=args.megatron_format or "torch_dist",
        with_optimizer=args.with_optimizer,
        megatron_optimizer=args.megatron_optimizer or "regular",
        with_initialised_heads=args.with_initialised_heads,
    )
    give_freed_tensors_back()
    start = time.perf_counter()
    try:
        warnings = convert(args.input, args.output, from_format=args.from_format, to_format=args.to_format,
                           model_family=args.model_family, options=options,
                           allow_unused_tensors=args.allow_unused_tensors,
                           dtype=getattr(torch, DTYPES[args.dtype]) if args.dtype else None)
    except (ConversionError, CheckpointError, PluginError, OSError) as error:
        print(f"mega convert: error: {error}", file=sys.stderr)
        print("mega convert: no output was written", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mega convert: interrupted; no output was written", file=sys.stderr)
        return 130
    for warning in warnings:
        print(f"mega convert: warning: {warning}", file=sys.stderr)
    print(f"mega convert: wrote {args.output} ({args.to_format}) in {time.perf_counter() - start:.1f} s")
    return 0


def list_architectures() -> int:
    """``--list-architectures``: one line per architecture, from the installed families."""
    # start-up cost, as in main: the families' mappings import torch
    from mega.ckpt_convert.hf_bridge import list_architectures as lines
    from mega.core.plugins import get_plugins

    models = get_plugins().models
    print("\n".join(lines({name: models.get(name) for name in models.names()})))
    return 0


def _check_output_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags that apply only to some outputs are refused elsewhere, naming the flag."""
    for flag, value in (("--target-tensor-parallel-size", args.target_tensor_parallel_size),
                        ("--target-pipeline-parallel-size", args.target_pipeline_parallel_size),
                        ("--target-expert-parallel-size", args.target_expert_parallel_size)):
        if value < 1:
            parser.error(f"{flag} must be at least 1")
        if value != 1 and args.to_format not in LAYOUT_OUTPUTS:
            parser.error(f"{flag} applies to mega and megatron outputs only (--to mega or --to megatron)")
    if args.with_optimizer and args.to_format not in LAYOUT_OUTPUTS:
        parser.error("--with-optimizer applies to mega and megatron outputs only (--to mega or --to megatron)")
    if args.with_initialised_heads and args.to_format != "hf":
        parser.error("--with-initialised-heads applies to hf outputs only (--to hf)")
    if args.megatron_format is not None and args.to_format != "megatron":
        parser.error("--megatron-format applies to megatron outputs only (--to megatron)")
    if args.megatron_optimizer is not None and (args.to_format != "megatron" or not args.with_optimizer
                                                or args.megatron_format == "legacy"):
        parser.error("--megatron-optimizer applies to megatron torch_dist outputs with --with-optimizer")


def _is_peft_adapter(args: argparse.Namespace) -> bool:
    """An input with no --from that is a PEFT adapter directory (it says what it is)."""
    return args.from_format is None and (Path(args.input) / "adapter_config.json").is_file()


def convert_peft(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--to hf-peft`` and ``--from hf-peft``: ``mega lora export-peft`` and ``import-peft`` by
    ``mega convert``'s spelling (one implementation, in :mod:`mega.ckpt_convert.lora_cli`)."""
    exporting = args.to_format == PEFT and not _is_peft_adapter(args)
    if exporting and args.from_format not in (None, "mega"):
        parser.error("--to hf-peft takes a mega checkpoint of a LoRA run (--from mega)")
    if not exporting and args.to_format != "mega":
        parser.error("--from hf-peft folds the adapter into a mega checkpoint: --to mega")
    if not exporting and not args.base:
        parser.error("--from hf-peft needs --base, the base model's mega checkpoint the adapter folds into")
    unused = [flag for flag, given in (
        ("--base", exporting and args.base), ("--base-model", not exporting and args.base_model),
        ("--model-family", args.model_family), ("--dtype", args.dtype), ("--with-optimizer", args.with_optimizer),
        ("--target-tensor-parallel-size", args.target_tensor_parallel_size != 1),
        ("--target-pipeline-parallel-size", args.target_pipeline_parallel_size != 1),
        ("--target-expert-parallel-size", args.target_expert_parallel_size != 1),
        ("--megatron-format", args.megatron_format), ("--megatron-optimizer", args.megatron_optimizer),
        ("--with-initialised-heads", args.with_initialised_heads),
        ("--allow-unused-tensors", args.allow_unused_tensors)) if given]
    if unused:
        parser.error(f"{', '.join(unused)} do(es) not apply to hf-peft conversions")

    # start-up cost, as in main: torch and the checkpoint code load only for a conversion
    from mega.ckpt_convert.lora_cli import LORA_ERRORS, export_peft, import_peft

    try:
        message = (export_peft(args.input, args.output, args.base_model) if exporting
                   else import_peft(args.base, args.input, args.output))
    except LORA_ERRORS as error:
        print(f"mega convert: error: {error}", file=sys.stderr)
        return 1
    print(f"mega convert: {message}")
    return 0
