"""The flags `mega generate` and `mega serve` share (model, tokenizer, decoding), checked before
torch is imported: a mistyped ``--load`` fails at once, not after seconds of imports."""

from __future__ import annotations

import argparse
from pathlib import Path

from mega.inference.dtypes import DTYPE_NAMES


def existing_path(value: str) -> str:
    if not Path(value).exists():
        raise argparse.ArgumentTypeError(f"{value}: no such file or directory")
    return value


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--load", required=True, metavar="PATH", type=existing_path,
                       help="mega checkpoint (save directory or one iteration's directory) or a Hugging "
                            "Face model directory (with config.json); a LoRA run's checkpoint alone loads the base "
                            "it records, with the adapters merged")
    group.add_argument("--adapter", metavar="DIR", type=existing_path,
                       help="a LoRA run's checkpoint (mega train --lora-rank ... --save DIR) whose adapters are "
                            "merged into --load's weights as the model loads; mega serve names the model after it")
    group.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available, "
                       "each torchrun rank its LOCAL_RANK's GPU)")
    group.add_argument("--dtype", choices=DTYPE_NAMES, default="float32",
                       help="parameter and activation dtype (default float32)")
    group.add_argument("--quantization", metavar="KIND", default=None,
                       help="quantize the linear layers' weights once loaded (the output layer and MoE routers "
                            "stay in --dtype), through the plugin registering the 'quantization' setup pass "
                            "(mega-torchao): int8 (per-row int8 weights, any device), fp8 (E4M3 weights; with "
                            "dynamically scaled FP8 activations on a GPU of compute capability 8.9+, weight-only on the "
                            "CPU), int4 (groups of 128 input features; CUDA with --dtype bfloat16, or the CPU). "
                            "Each tensor-parallel rank quantizes its shards; a kind the device cannot run is "
                            "refused, saying why. The weight bytes before and after are printed")
    group = parser.add_argument_group("tokenizer (default: the one the checkpoint names)")
    group.add_argument("--tokenizer-type", help="registered tokenizer, e.g. GPT2BPETokenizer, HuggingFaceTokenizer")
    group.add_argument("--vocab-file", help="vocabulary (GPT-2 vocab.json, BERT vocab.txt)")
    group.add_argument("--merge-file", help="BPE merges (GPT-2 merges.txt)")
    group.add_argument("--tokenizer-model", help="SentencePiece .model, tokenizer.json (or its directory), .tiktoken")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer ids")


def add_decoding_arguments(group: argparse._ArgumentGroup, applies: str) -> None:
    """``--static-kv-cache`` and ``--no-cuda-graphs``; ``applies`` says where the static cache can run."""
    group.add_argument("--static-kv-cache", action=argparse.BooleanOptionalAction, default=None,
                       help="decode with a static KV cache (a slot of the model's positions per sequence, fixed "
                            "shapes per batch-size bucket) and, on CUDA, a captured CUDA graph of the decode step; "
                            f"{applies}. Default: on on CUDA (where it applies), off on CPU")
    group.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                       help="with the static KV cache on CUDA, run each decode step eagerly instead of replaying "
                            "a captured CUDA graph")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile the static KV cache's decode step (implies --static-kv-cache; "
                            "decoder-only models): fused kernels, fewer per step, which its CUDA graphs then "
                            "capture; the first steps of the first two batch sizes wait for it to compile")
    add_speculative_arguments(group)
    group.add_argument("--compile-backend", default="inductor",
                       help="torch.compile backend for --compile (inductor; on CPU it needs a C++ compiler; "
                            "aot_eager traces without generating code)")


def add_speculative_arguments(group: argparse._ArgumentGroup) -> None:
    """Speculative decoding (vLLM's ``speculative_config`` names, as flags)."""
    group.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                       help="speculative decoding: draft up to K tokens per sequence and step, verified by the model "
                            "in one forward (greedy output unchanged, sampling keeps the model's distribution; steps "
                            "where a sequence asks log-probabilities or penalties decode one token). Default 0: off")
    group.add_argument("--speculative-method", choices=("ngram", "draft_model", "mtp"), default=None,
                       help="where drafts come from: ngram (prompt lookup: what followed the sequence's last n-gram "
                            "earlier in it; no extra model), draft_model (--speculative-model) or mtp (vLLM's "
                            "deepseek_mtp: the model's own multi-token-prediction layers, a DeepSeek-V3 trained with "
                            "--mtp-num-layers, fed the model's hidden states; K beyond the MTP layers reuses the "
                            "last layer recursively, as vLLM does; turns prefix caching off). Default: draft_model with "
                            "--speculative-model, else ngram")
    group.add_argument("--speculative-model", metavar="DIR", type=existing_path,
                       help="a smaller model sharing the tokenizer (mega checkpoint or Hugging Face directory) that "
                            "drafts the tokens")
    group.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="N",
                       help="steps with N or more sequences decode one token each, without drafts (vLLM's "
                            "speculative_disable_by_batch_size): drafts pay at small batches; at large ones a "
                            "rejected draft costs every row. Default: speculate at every batch size")
    group.add_argument("--prompt-lookup-max", type=int, default=4, metavar="N",
                       help="ngram drafts: the longest suffix looked up (default 4)")
    group.add_argument("--prompt-lookup-min", type=int, default=1, metavar="N",
                       help="ngram drafts: the shortest suffix looked up (default 1)")


def compile_backend(args: argparse.Namespace) -> str | None:
    """The torch.compile backend of the decode step under ``--compile``, else None (eager)."""
    return args.compile_backend if getattr(args, "compile", False) else None
