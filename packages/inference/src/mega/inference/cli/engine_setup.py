"""What ``mega generate`` and ``mega serve`` both do first: join torchrun's ranks (if any) as one
tensor-parallel group, load the model, make the engine and its loop (the one worker both run:
:func:`build_worker`), and set the followers following."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from mega.core.checkpoint import CheckpointError
from mega.core.parallel import Group, ParallelConfig, ParallelGroups
from mega.core.process_group import init_distributed
from mega.inference.cli.load_arguments import compile_backend
from mega.inference.cli.lora_serving import serve_adapters
from mega.inference.engine import GenerationEngine, GenerationError
from mega.inference.engine.continuous import BLOCK_SIZE, ContinuousBatchingWorker
from mega.inference.engine.cpu_weight_layout import hold_linear_weights_column_major
from mega.inference.engine.encoder_decoder import (
    EncoderDecoderEngine,
    EncoderDecoderWorker,
    is_encoder_decoder,
)
from mega.inference.engine.lora_registry import AdapterRegistry
from mega.inference.engine.mtp_proposer import MTPProposer
from mega.inference.engine.slot_kv_cache import static_kv_cache_wanted
from mega.inference.engine.speculative import DraftModelProposer, NgramProposer, Speculator
from mega.inference.engine.tp_serving import lead, receive
from mega.inference.engine.worker import EngineWorker
from mega.inference.loader import DTYPES, LoadedModel, LoadError, load_from_args, load_model


@dataclass
class EngineSetup:
    engine: GenerationEngine
    loaded: LoadedModel
    tp_group: Group
    worker: EngineWorker
    adapters: AdapterRegistry | None = None  # LoRA adapters chosen per request (mega serve --lora-modules)


def static_kv_cache(args: argparse.Namespace, device, decoder_only: bool = True) -> bool:
    """Whether the loop decodes on the static KV cache: as ``--static-kv-cache`` asks, else on
    CUDA (tensor-parallel too) unless ``--max-num-tokens`` sizes a paged cache."""
    requested = args.static_kv_cache
    if requested is None and getattr(args, "max_num_tokens", None) is not None:
        requested = False
    return static_kv_cache_wanted(requested, device, decoder_only, "for decoder-only models")


def build_worker(args: argparse.Namespace, engine) -> EngineWorker:
    """The loop ``mega generate`` and ``mega serve`` submit to, built alike on the leader and on
    every follower: continuous batching for a decoder (its cache as the flags say), batches of
    encoded prompts for an encoder-decoder model. A flag the model's loop cannot take raises
    :class:`GenerationError` naming it."""
    encoder_decoder = is_encoder_decoder(engine.model)
    static = static_kv_cache(args, engine.device, not encoder_decoder)
    if encoder_decoder:
        if getattr(args, "enable_prefix_caching", None) or getattr(args, "max_num_batched_tokens", None) is not None:
            raise GenerationError("--enable-prefix-caching and --max-num-batched-tokens run for decoder-only models")
        return EncoderDecoderWorker(engine, args.max_batch_size)
    prefix_caching = getattr(args, "enable_prefix_caching", None)
    if getattr(args, "speculative_method", None) == "mtp":
        if prefix_caching:  # a prefix taken from the cache has no hidden states for the MTP layer
            raise GenerationError("--speculative-method mtp feeds the MTP layer the model's hidden state at every "
                                  "prompt position, which a cached prefix skips: drop --enable-prefix-caching")
        prefix_caching = False
    return ContinuousBatchingWorker(engine, args.max_batch_size, getattr(args, "max_num_tokens", None),
                                    static_cache=static,
                                    use_cuda_graphs=args.cuda_graphs and engine.device.type == "cuda",
                                    prefix_caching=prefix_caching is not False,
                                    max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
                                    compile_backend=compile_backend(args) if static else None,
                                    speculator=build_speculator(args, engine))


def build_speculator(args: argparse.Namespace, engine) -> Speculator | None:
    """The speculator ``--num-speculative-tokens`` asks for (None: off), its drafts from prompt
    lookup, ``--speculative-model`` (loaded on the engine's device, at its dtype) or the model's
    own MTP layers."""
    count = getattr(args, "num_speculative_tokens", 0) or 0
    method = getattr(args, "speculative_method", None)
    draft_dir = getattr(args, "speculative_model", None)
    disable_by = getattr(args, "speculative_disable_by_batch_size", None)
    if count <= 0:
        if method is not None or draft_dir is not None or disable_by is not None:
            raise GenerationError("--speculative-method, --speculative-model and --speculative-disable-by-batch-size "
                                  "need --num-speculative-tokens K > 0")
        return None
    if disable_by is not None and disable_by < 2:
        raise GenerationError(f"--speculative-disable-by-batch-size must be at least 2, got {disable_by}")
    if engine.tp_group is not None and engine.tp_group.size > 1:
        raise GenerationError("--num-speculative-tokens runs on one rank: not under torchrun's tensor parallelism")
    method = method or ("draft_model" if draft_dir else "ngram")
    tokens = getattr(args, "max_num_tokens", None) or args.max_batch_size * engine.max_positions
    if method == "mtp":
        if draft_dir is not None:
            raise GenerationError("--speculative-method mtp drafts with the model's own MTP layers: drop "
                                  "--speculative-model")
        return Speculator(MTPProposer(engine, args.max_batch_size, tokens, BLOCK_SIZE), count,
                          disable_by_batch_size=disable_by)
    if method == "ngram":
        if draft_dir is not None:
            raise GenerationError("--speculative-method ngram drafts without a model: drop --speculative-model")
        return Speculator(NgramProposer(args.prompt_lookup_max, args.prompt_lookup_min), count,
                          disable_by_batch_size=disable_by)
    if draft_dir is None:
        raise GenerationError("--speculative-method draft_model needs --speculative-model DIR")
    try:
        draft = load_model(draft_dir, groups=ParallelGroups(ParallelConfig(tp=1)), device=engine.device,
                           dtype=DTYPES[args.dtype])
    except (LoadError, CheckpointError) as error:
        raise GenerationError(f"--speculative-model: {error}") from None
    if draft.config.vocab_size != engine.vocab_size:
        raise GenerationError(f"--speculative-model has {draft.config.vocab_size} tokens, the model "
                              f"{engine.vocab_size}: a draft shares the model's tokenizer")
    draft_engine = GenerationEngine(draft.model, vocab_size=draft.config.vocab_size,
                                    max_positions=min(draft.max_positions, engine.max_positions))
    return Speculator(DraftModelProposer(draft_engine, args.max_batch_size, tokens, BLOCK_SIZE), count,
                      disable_by_batch_size=disable_by)


def load_on_ranks(args: argparse.Namespace, command: str) -> tuple[LoadedModel, ParallelGroups]:
    """Join torchrun's ranks (if any) as one tensor-parallel group and load ``--load`` at that
    size; a model that cannot be loaded ends ``mega <command>`` with one line naming the problem."""
    init_distributed()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    groups = ParallelGroups(ParallelConfig(tp=world))
    try:
        loaded = load_from_args(args, groups)
    except (LoadError, CheckpointError) as error:
        raise SystemExit(f"mega {command}: error: {error}") from None
    if loaded.quantized is not None and groups.tp.rank == 0:
        print(f"mega {command}: {loaded.quantized.describe()}", file=sys.stderr, flush=True)
    return loaded, groups


def setup_engine(args: argparse.Namespace, command: str) -> EngineSetup | None:
    """The engine and its worker for ``mega <command>`` on the leading rank; None on the other
    ranks of the tensor group, once they have followed the leader's steps to the end. A model,
    tokenizer or flag that cannot be used ends the command with one line naming the problem. A
    ``--max-model-len`` caps every rank's engine (and so the caches sized from it)."""
    if getattr(args, "compile", False):
        # What compiles is the static cache's decode step, whose shapes are fixed per batch bucket.
        if args.static_kv_cache is False:
            raise SystemExit(f"mega {command}: error: --compile decodes on the static KV cache; drop "
                             "--no-static-kv-cache")
        args.static_kv_cache = True
    loaded, groups = load_on_ranks(args, command)
    # The one place the model kind picks the engine: encoder-decoder models (T5) have their own.
    engine_class = EncoderDecoderEngine if is_encoder_decoder(loaded.model) else GenerationEngine
    engine = engine_class(loaded.model, vocab_size=loaded.config.vocab_size,
                          max_positions=loaded.max_positions, tokenizer=loaded.tokenizer, tp_group=groups.tp)
    hold_linear_weights_column_major(loaded.model)  # on the CPU: decoding's products several times faster
    max_model_len = getattr(args, "max_model_len", None)
    if max_model_len is not None and max_model_len > engine.max_positions:
        if engine.is_leader:  # every rank checks the same: the followers return
            raise SystemExit(f"mega {command}: error: --max-model-len {max_model_len} exceeds the model's "
                             f"{engine.max_positions} positions")
        return None
    if max_model_len is not None:
        engine.cap_length(max_model_len)
    try:
        adapters = serve_adapters(args, engine, loaded, groups)  # None unless LoRA adapters are served
        worker = build_worker(args, engine)
    except (GenerationError, ValueError) as error:
        if engine.is_leader:
            lead(None, groups.tp)  # the other ranks stop following
            raise SystemExit(f"mega {command}: error: {error}") from None
        while receive(groups.tp) is not None:  # the leader refuses the same flags: it says why
            pass
        return None
    if not engine.is_leader:
        worker.follow()
        return None
    if loaded.tokenizer is None:
        lead(None, groups.tp)
        print(f"mega {command}: the checkpoint names no tokenizer: give --tokenizer-type (and its files)",
              file=sys.stderr)
        raise SystemExit(2)
    return EngineSetup(engine, loaded, groups.tp, worker, adapters)

