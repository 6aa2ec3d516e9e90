"""megatron-core's regular optimizer over its ``BertModel`` and ``T5Model`` (Megatron-LM's default T5)
at tp 2, saved as Megatron-LM's legacy files and loaded back as its load_checkpoint does, on the
ranks of the 2-rank gloo world: the reference for legacy optimizer state of the encoder families.
The models, args and CPU shims are the family references'."""

from __future__ import annotations

from pathlib import Path

import megatron_bert_reference as bert_ref
import megatron_t5_reference as t5_ref
import torch
from megatron_reference import _optimizer, _state_by_name, step_with_random_gradients, write_rank_file

TP, ITERATION = 2, 9


def _model(family: str, seed: int):
    if family == "bert":
        return bert_ref.bert_model(TP, seed=seed)
    return t5_ref.t5_model(TP, seed=seed, architecture="megatron")


def _args(family: str):
    if family == "bert":
        return bert_ref.bert_megatron_args(TP, 1, ITERATION, "torch")
    return t5_ref.t5_megatron_args(TP, ITERATION, "torch", "megatron")


def _rank_file(directory: str) -> Path:
    return Path(directory) / f"iter_{ITERATION:07d}" / f"mp_rank_{torch.distributed.get_rank():02d}" / "model_optim_rng.pt"


def save_legacy_with_optimizer(family: str, directory: str, steps: int = 2) -> dict:
    """Legacy tp 2 files of a run trained ``steps`` Adam steps (random gradients, the same on both
    ranks for a replicated parameter, as training makes them), each holding ``optimizer.state_dict()``:
    this rank's optimizer state by parameter name."""
    rank = torch.distributed.get_rank()
    model = _model(family, seed=5)
    optimizer = _optimizer(model)
    step_with_random_gradients(
        model, optimizer, steps,
        lambda name, param: f"{rank if getattr(param, 'tensor_model_parallel', False) else -1}/{name}")
    args = _args(family)
    args.consumed_train_samples = ITERATION * 4
    write_rank_file(directory, f"mp_rank_{rank:02d}", args, ITERATION, model, optimizer)
    return _state_by_name(model, optimizer)


def load_legacy_optimizer(family: str, directory: str) -> dict:
    """This rank's file loaded into a fresh model (strict) and optimizer: its state by parameter name."""
    model = _model(family, seed=77)
    optimizer = _optimizer(model)
    state = torch.load(_rank_file(directory), weights_only=False)
    model.load_state_dict(state["model"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    return _state_by_name(model, optimizer)
