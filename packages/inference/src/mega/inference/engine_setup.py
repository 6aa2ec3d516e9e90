"""What ``mega generate`` and ``mega serve`` both do first: join torchrun's ranks (if any) as one
tensor-parallel group, load the model, make the engine, and set the followers following."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from mega.core.checkpoint import CheckpointError
from mega.core.parallel import Group, ParallelConfig, ParallelGroups
from mega.core.process_group import init_distributed
from mega.inference.encoder_decoder import EncoderDecoderEngine, is_encoder_decoder
from mega.inference.engine import GenerationEngine
from mega.inference.loader import LoadedModel, LoadError, load_from_args
from mega.inference.tp_serving import follow, lead


@dataclass
class EngineSetup:
    engine: GenerationEngine
    loaded: LoadedModel
    tp_group: Group


def load_on_ranks(args: argparse.Namespace, command: str) -> tuple[LoadedModel, ParallelGroups]:
    """Join torchrun's ranks (if any) as one tensor-parallel group and load ``--load`` at that
    size; a model that cannot be loaded ends ``mega <command>`` with one line naming the problem."""
    init_distributed()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    groups = ParallelGroups(ParallelConfig(tp=world))
    try:
        return load_from_args(args, groups), groups
    except (LoadError, CheckpointError) as error:
        raise SystemExit(f"mega {command}: error: {error}") from None


def setup_engine(args: argparse.Namespace, command: str, generate_for=None, follower=None) -> EngineSetup | None:
    """The engine for ``mega <command>`` on the leading rank; None on the other ranks of the
    tensor group, once they have followed the leader's batches to the end. A model or tokenizer
    that cannot be loaded ends the command with one line naming the problem. ``generate_for(engine)``:
    how the leader generates (the engine's own ``generate`` by default), which the followers run
    too; ``follower(engine)``: a follower's whole loop instead (continuous batching's). A
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
    max_model_len = getattr(args, "max_model_len", None)
    if max_model_len is not None and max_model_len > engine.max_positions:
        if engine.is_leader:  # every rank checks the same: the followers return
            raise SystemExit(f"mega {command}: error: --max-model-len {max_model_len} exceeds the model's "
                             f"{engine.max_positions} positions")
        return None
    if max_model_len is not None:
        engine.cap_length(max_model_len)
    if not engine.is_leader:
        if follower is not None:
            follower(engine)
        else:
            follow(engine, groups.tp, generate_for(engine) if generate_for is not None else None)
        return None
    if loaded.tokenizer is None:
        lead(None, groups.tp)
        print(f"mega {command}: the checkpoint names no tokenizer: give --tokenizer-type (and its files)",
              file=sys.stderr)
        raise SystemExit(2)
    return EngineSetup(engine, loaded, groups.tp)

