"""Adam state in Megatron-LM's torch_dist checkpoints, read and written.

megatron-core saves the optimizer's ``sharded_state_dict`` beside the model's under ``optimizer``:

* each per-parameter tensor as ``optimizer.state.<key>.<model key>``, shaped (and stacked over
  the layers) like the parameter it belongs to: ``exp_avg``, ``exp_avg_sq``, and the fp32 main
  parameter of a bf16/fp16 model (``fp32_param``; ``param`` in a distributed optimizer's
  ``fully_reshardable`` save). The regular optimizer and the distributed optimizer's layout-free
  kinds (``fully_reshardable``, ``fully_sharded_model_space``) write these;
* in ``common.pt``: ``optimizer.param_groups`` (hyperparameters, without the params) and the
  step count, shared by every parameter, as ``optimizer.state.common_step`` (regular optimizer)
  or in each param group (distributed optimizer: ``optimizer.optimizer.param_groups``, beside
  ``param_state_sharding_type``; ``content_metadata`` names the kind for Megatron-LM's loader).

Exports write the regular optimizer's state, or the distributed optimizer's as
``fully_reshardable`` (its main parameters always, fp32 runs too, under ``param``).

The distributed optimizer's ``dp_reshardable`` kind (Megatron-LM's default without
``--dist-ckpt-optim-fully-reshardable``) saves its flat internal buffers, tied to the data-parallel
layout, under ``optimizer.distributed.*``: :mod:`mega.ckpt_convert.megatron.buffer_optimizer` reads those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.megatron.chained import unchained
from mega.ckpt_convert.megatron.param_order import param_groups
from mega.ckpt_convert.optimizer_state import MAIN_PARAM, MOMENTS, OptimizerState
from mega.ckpt_convert.source import format_names

STATE_PREFIX = "optimizer.state."
# Megatron's state key -> mega's
TO_MEGA = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": MAIN_PARAM, "param": MAIN_PARAM}
MAIN_PARAM_KEY = "fp32_param"
TO_MEGATRON = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", MAIN_PARAM: MAIN_PARAM_KEY}
# The distributed optimizer's layout-free kind (one tensor per parameter and kind, like the
# regular optimizer's, its main parameters always and under ``param``): what exports write for it.
FULLY_RESHARDABLE = "fully_reshardable"
DISTRIBUTED_MAIN_PARAM_KEY = "param"
BUFFER_LAYOUT = ("optimizer.distributed.", "optimizer.param_state")


@dataclass
class FoundOptimizer:
    state: OptimizerState
    keys: dict[str, dict[str, tuple[str, int | None]]]  # mega key -> mega name -> (index key, layer)
    index: dict  # index key (no chained_N. prefix) -> its DCP metadata
    stored_keys: dict[str, str]  # index key -> the key in the files, where a chained optimizer prefixed it


def read_optimizer_state(source, common: dict, metadata, names) -> FoundOptimizer:
    """The optimizer state of a torch_dist checkpoint ``source`` (its ``common.pt`` dict and
    DCP ``metadata``), checked to cover every parameter at the parameter's shape."""
    where = source.directory
    everything = metadata.state_dict_metadata
    saved = _saved_optimizer(common.get("optimizer"), where)
    stored_keys = {unchained(key): key for key, md in everything.items()
                   if unchained(key).startswith(STATE_PREFIX) and isinstance(md, TensorStorageMetadata)}
    index = {key: everything[stored] for key, stored in stored_keys.items()}
    if not isinstance(saved, dict) or not index:
        raise ConversionError(f"--with-optimizer: {where} holds no optimizer state (Megatron-LM saved it with "
                              "--no-save-optim, or it is a release checkpoint)")
    keys = {TO_MEGA[state_key]: _state_keys(source, index, names, state_key)
            for state_key in _state_kinds(source, index)}
    if set(MOMENTS) - set(keys):
        raise ConversionError(f"{where}: the optimizer state lacks {', '.join(sorted(set(MOMENTS) - set(keys)))}; "
                              "mega carries Adam's exp_avg and exp_avg_sq")
    groups = saved.get("param_groups") or [{}]
    step = _step(saved)
    if step is None:
        raise ConversionError(f"{where}: the optimizer state has no step count (optimizer.state.common_step "
                              "or param_groups[].step in common.pt)")
    hyper = {k: groups[0][k] for k in ("lr", "betas", "eps", "weight_decay") if k in groups[0]}
    if isinstance(common.get("opt_param_scheduler"), dict):
        hyper["schedule"] = common["opt_param_scheduler"]
    state = OptimizerState(
        keys=tuple(sorted(keys)), step=int(step), iteration=int(source.iteration or 0),
        consumed_samples=int(getattr(source.args, "consumed_train_samples", 0) or 0), hyperparameters=hyper)
    return FoundOptimizer(state, keys, index, {key: stored for key, stored in stored_keys.items() if key != stored})


def _saved_optimizer(saved, where):
    """``common.pt``'s optimizer entry holding the param groups: a chained pair's first (steps
    checked equal), the distributed optimizer's inner one."""
    if isinstance(saved, dict) and saved and all(isinstance(k, int) for k in saved):  # a chained optimizer's
        steps = {_step(part) for part in saved.values()}
        if len(steps) != 1:
            raise ConversionError(f"{where}: the chained optimizers' step counts differ: {sorted(map(str, steps))}")
        saved = saved[min(saved)]  # megatron-core keeps them in step; the first's param groups serve
    if isinstance(saved, dict) and "param_state_sharding_type" in saved:  # the distributed optimizer's
        saved = saved.get("optimizer")
    return saved


def _state_kinds(source, index: dict) -> list[str]:
    """The Megatron state keys (``exp_avg``...) that ``index`` holds and mega carries."""
    kinds = []
    # The distributed optimizer saves main parameters of an fp32 model too: the weights themselves.
    fp32_model = all(source.dtype(name) == torch.float32 for name in source.layouts)
    for key in index:
        state_key = key[len(STATE_PREFIX):].partition(".")[0]
        if state_key not in TO_MEGA:
            raise ConversionError(f"{source.directory}: {key} is optimizer state mega does not know ({state_key!r}; "
                                  f"it carries {', '.join(sorted(TO_MEGA))}): an optimizer other than Adam?")
        if not (fp32_model and TO_MEGA[state_key] == MAIN_PARAM) and state_key not in kinds:
            kinds.append(state_key)
    return kinds


def _state_keys(source, index: dict, names, state_key: str) -> dict[str, tuple[str, int | None]]:
    """mega name -> (index key, layer) of one kind of state, checked to be the model's parameters
    at their shapes."""
    where = source.directory
    mapped, shapes = source.map_keys(index, names, f"{STATE_PREFIX}{state_key}.")
    tied_copy = next((n for n in names.tied_copies if f"{STATE_PREFIX}{state_key}.{n}" in index), None)
    embedding = "embedding.word_embeddings.weight"
    if embedding not in mapped and tied_copy is not None:  # the shared weight's state under the output layer's key
        mapped[embedding] = (f"{STATE_PREFIX}{state_key}.{tied_copy}", None)
        shapes[embedding] = (tuple(index[mapped[embedding][0]].size), None)
    trained = {name for name, layout in source.layouts.items() if layout.trained}  # frozen ones have no state
    missing, unexpected = trained - set(mapped), set(mapped) - trained
    if missing or unexpected:
        raise ConversionError(f"{where}: the optimizer's {state_key} " + " and ".join(
            ([f"lacks {format_names(missing)}"] if missing else [])
            + ([f"holds {format_names(unexpected)}"] if unexpected else [])) + ", unlike the model")
    for name, (shape, _) in shapes.items():
        if tuple(shape) != tuple(source.shape(name)):
            raise ConversionError(f"{where}: the optimizer's {state_key} of {name} has shape {list(shape)}, "
                                  f"its parameter {list(source.shape(name))}")
    return mapped


def _step(saved: dict):
    """The step count ``common.pt`` keeps for an optimizer (regular: common_step; distributed: in the groups)."""
    groups = saved.get("param_groups") or [{}]
    step = (saved.get("state") or {}).get("common_step", groups[0].get("step"))
    return None if step is None else int(step)


def common_optimizer(state: OptimizerState) -> dict:
    """What ``common.pt`` holds under ``optimizer`` for megatron-core's regular optimizer."""
    return {"state": {"common_step": torch.tensor(float(state.step))}, "param_groups": param_groups(state)}


def distributed_common_optimizer(state: OptimizerState) -> tuple[dict, dict]:
    """What ``common.pt`` holds under ``optimizer`` for megatron-core's distributed optimizer, whose
    per-parameter state is saved :data:`FULLY_RESHARDABLE`, and the ``content_metadata`` that
    tells Megatron-LM's load_checkpoint so. The step is in every param group."""
    groups = [dict(group, step=state.step) for group in param_groups(state)]
    return {"optimizer": {"param_groups": groups}, "param_state_sharding_type": FULLY_RESHARDABLE}, \
        {"distrib_optim_sharding_type": FULLY_RESHARDABLE}
