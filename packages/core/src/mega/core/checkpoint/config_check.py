"""A checkpoint resumes only into the model it was saved from.

Shapes do not tell every model apart: 8 heads of 8 channels in 4 groups have the QKV weight of 4
heads of 16 channels in 2 groups, and RoPE's base or a norm's epsilon have no shape at all. A
model loaded under another such setting computes another function with the same weights, so
the saved model configuration is compared with the run's, field by field, before anything is
loaded. Only what is meant to change on a resume or a fine-tune may differ: how the model is
run (recompute, the attention kernel, the vocabulary padding, which takes no part in any
result), how it is trained (dropout, the initialisation that loading replaces), the sequence
length (up to the position table, whose size is a saved field) and, on a model without a
position table (RoPE), a longer ``max_position_embeddings``, which is then only a number. Layout,
batch sizes, schedule, precision and kernels are not model settings and may change freely.
docs/finetuning.md has the table.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mega.core.checkpoint.metadata import CheckpointError
from mega.core.config.options import flag_of

MAY_CHANGE_ON_RESUME = frozenset({
    "seq_length", "make_vocab_size_divisible_by", "init_method_std", "hidden_dropout", "attention_dropout",
    "attention_backend", "recompute_granularity", "recompute_method", "recompute_num_layers",
    # Mixture of experts: how tokens reach the experts and how the experts run (the same function),
    # and the router's auxiliary training losses.
    "moe_token_dispatcher_type", "moe_grouped_gemm",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
    # Fusions: the same arithmetic in fewer kernels.
    "bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion", "cross_entropy_loss_fusion",
})
_HINTS = {"vocab_size": " (check the tokenizer)"}


def check_model_config(path: Path, saved: dict[str, Any], current: Any) -> None:
    """Raise naming every field of the dataclass ``current`` (and its flag) whose saved value
    differs from this run's, other than those that may change on a resume. Fields the checkpoint
    does not record (an older mega) are not compared."""
    differences = model_config_differences(saved, current)
    if differences:
        raise CheckpointError(f"{path} does not match this model: it was saved with " + "; ".join(differences)
                              + ". Give the settings it was saved with (or leave their flags out: a run that "
                              "loads a checkpoint takes its model from it): loading it otherwise would compute "
                              "another function with the same weights")


def model_config_differences(saved: dict[str, Any], current: Any) -> list[str]:
    """Each field of ``current`` that differs from ``saved`` where that changes the model's function,
    as ``name (--flag) saved where this run has current``."""
    return [
        f"{field.name} ({flag_of(field)}) {saved[field.name]!r} where this run has "
        f"{getattr(current, field.name)!r}{_HINTS.get(field.name, '')}"
        for field in dataclasses.fields(current)
        if field.name in saved and not may_change(field.name, saved, getattr(current, field.name))
        and not _same(saved[field.name], getattr(current, field.name))
    ]


def may_change(name: str, saved: dict[str, Any], value: Any) -> bool:
    """Whether the field ``name`` may take ``value`` in a run that loads a model saved as ``saved``."""
    if name in MAY_CHANGE_ON_RESUME:
        return True
    if name == "max_position_embeddings":
        # Without a learned position table the number bounds nothing the weights hold: a longer
        # context on a RoPE model is the same function on every position both reach.
        no_table = saved.get("position_embedding_type", "learned_absolute") != "learned_absolute"
        return no_table and isinstance(value, int) and value >= saved[name]
    return False


def _same(saved: Any, current: Any) -> bool:
    # The metadata is JSON: tuples come back as lists, floats written as ints (10000 vs 10000.0) agree.
    if isinstance(saved, list | tuple) and isinstance(current, list | tuple):
        return len(saved) == len(current) and all(_same(a, b) for a, b in zip(saved, current, strict=True))
    return saved == current
