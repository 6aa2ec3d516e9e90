"""Adam state in Megatron-LM's legacy files (``--ckpt-format torch``, the regular optimizer), read and
written.

Megatron-LM's ``save_checkpoint`` stores each rank's ``optimizer.state_dict()`` beside its model:

* megatron-core's ``FP32Optimizer`` (fp32 runs): torch Adam's own state dict, ``state``
  (parameter index -> ``step``, ``exp_avg``, ``exp_avg_sq``) and ``param_groups`` (each with its
  ``params`` indices and megatron's ``wd_mult``, ``lr_mult``...);
* ``Float16OptimizerWithFloat16Params`` (bf16/fp16 runs): ``{"optimizer": that state dict, of the
  fp32 main parameters, "fp32_from_fp16_params": per group, the main parameters, "grad_scaler"}``.

The indices number the rank's parameters group by group, each group in the model's parameter order
(megatron-core's ``_get_param_groups``): the weight-decayed parameters first, then biases and
1-D parameters (the group whose ``wd_mult`` is 0). The parameter order is read from the file: its
model state dict's tensors in order (``_extra_state`` left out; the chunks of an interleaved
pipeline one after the other), checked against the group sizes and every state tensor's shape.
Exports write each rank's model state dict in megatron-core's parameter order (:data:`ORDERS`: GPT,
LLaMA, Mixtral, BERT, T5), so that the same reading gives the indices megatron-core's optimizer loads. A
second name of a tensor (T5's ``output_layer.bias``) is no parameter of its own.
A mixture of experts' run under expert parallelism keeps two (megatron-core's chained optimizer,
saved as a list): the dense parameters' and the experts' (:func:`~mega.ckpt_convert.megatron.chained.chained_parts`), each numbered
on its own; exports (expert-parallel size 1) write one, as megatron-core keeps one there.
"""

from __future__ import annotations

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.megatron.param_order import groups_in_order, param_groups
from mega.ckpt_convert.optimizer_state import MAIN_PARAM, MOMENTS, OptimizerState


def read_rank_optimizer(saved, parameters: list[tuple[str, torch.Tensor]], where: str):
    """Index the optimizer state of one rank file: (file key -> {mega key: tensor}, step, group 0's
    hyperparameters). ``parameters``: the file's (model key, tensor) in the model's order."""
    if not isinstance(saved, dict):
        raise ConversionError(f"--with-optimizer: {where} holds no optimizer state (Megatron-LM saved it with "
                              "--no-save-optim, or it is a release checkpoint)")
    inner, mains = (saved["optimizer"], saved.get("fp32_from_fp16_params")) if "optimizer" in saved else (saved, None)
    groups, states = inner.get("param_groups"), inner.get("state")
    if not isinstance(groups, list) or not isinstance(states, dict):
        raise ConversionError(f"{where}: the optimizer state has no param_groups and state (not torch Adam's)")
    decayed, plain = groups_in_order(parameters)
    shapes = {key: tuple(tensor.shape) for key, tensor in parameters}
    found: dict[str, dict[str, torch.Tensor]] = {}
    steps = set()
    for g, group in enumerate(groups):
        keys = plain if group.get("wd_mult", 1.0) == 0.0 else decayed
        indices = group.get("params", [])
        if len(indices) != len(keys):
            raise ConversionError(f"{where}: optimizer param group {g} (wd_mult {group.get('wd_mult', 1.0)}) holds "
                                  f"{len(indices)} parameters, but the model state dict has {len(keys)} such "
                                  "(megatron-core's grouping: biases and 1-D parameters apart); they disagree")
        for position, (index, key) in enumerate(zip(indices, keys, strict=True)):
            state = states.get(index, {})
            tensors = {name: state[name] for name in MOMENTS if name in state}
            if mains is not None:
                tensors[MAIN_PARAM] = mains[g][position]
            for name, tensor in tensors.items():
                if tuple(tensor.shape) != shapes[key]:
                    raise ConversionError(f"{where}: the optimizer's {name} of parameter {index} ({key}) has shape "
                                          f"{list(tensor.shape)}, the parameter {list(shapes[key])}")
            if set(MOMENTS) - set(tensors):
                raise ConversionError(f"{where}: the optimizer holds no Adam moments for parameter {index} ({key})")
            if "step" in state:
                steps.add(int(state["step"]))
            found[key] = tensors
    if "common_step" in states:
        steps.add(int(states["common_step"]))
    if len(steps) != 1:
        raise ConversionError(f"{where}: the optimizer's step counts are {sorted(steps) or 'missing'}; mega carries "
                              "one step shared by every parameter")
    hyper = {k: groups[0][k] for k in ("lr", "betas", "eps", "weight_decay") if groups and k in groups[0]}
    return found, steps.pop(), hyper


def rank_optimizer(parameters: list[tuple[str, torch.Tensor]], state_of, optimizer: OptimizerState) -> dict:
    """One rank's ``optimizer`` entry as megatron-core's regular optimizer saves it, for the rank's
    ``parameters`` (key, tensor) in megatron-core's parameter order; ``state_of(key)``: that
    parameter's {mega key: local tensor}. Groups without parameters are left out, as megatron-core
    makes none."""
    groups, states, mains, index = [], {}, [], 0
    for group, keys in zip(param_groups(optimizer), groups_in_order(parameters), strict=True):
        if not keys:
            continue
        groups.append(group)
        group["params"] = list(range(index, index + len(keys)))
        group_mains = []
        for key in keys:
            tensors = state_of(key)
            states[index] = {"step": torch.tensor(float(optimizer.step)),
                             **{name: tensors[name].float().clone() for name in MOMENTS}}
            if MAIN_PARAM in optimizer.keys:
                group_mains.append(tensors[MAIN_PARAM].float().clone())
            index += 1
        mains.append(group_mains)
    inner = {"state": states, "param_groups": groups}
    return {"optimizer": inner, "fp32_from_fp16_params": mains} if MAIN_PARAM in optimizer.keys else inner
