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
saved as a list): the dense parameters' and the experts' (:func:`chained_parts`), each numbered
on its own; exports (expert-parallel size 1) write one, as megatron-core keeps one there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.megatron_names import split_stack_layer
from mega.ckpt_convert.megatron_optimizer import param_groups
from mega.ckpt_convert.optimizer_state import MAIN_PARAM, MOMENTS, OptimizerState


@dataclass(frozen=True)
class ParameterOrder:
    """megatron-core's registration order of one family's parameters: the model's parts (its stacks
    of layers among them), then a layer's modules (its Attention registers linear_proj before
    SelfAttention adds linear_qkv); weight before bias."""

    parts: tuple[str, ...]
    layer: tuple[str, ...]

    def key(self, name: str) -> tuple:
        """Sort key putting a state dict name in the order (a module's numbered parts, such as
        experts, in their numbers' order)."""
        part = _position(name, self.parts, "parameter")
        layer = split_stack_layer(name)
        if layer is None or layer[0] != self.parts[part]:
            return part, 0, 0, name.endswith(".bias"), ()
        _, number, rest = layer
        numbered = tuple(int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", rest))
        return part, number, _position(rest, self.layer, "layer parameter"), rest.endswith(".bias"), numbered


_LAYER = ("input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.", "pre_mlp_layernorm.",
          "mlp.linear_fc1.", "mlp.linear_fc2.")
DECODER_ONLY_ORDER = ParameterOrder(
    ("embedding.word_embeddings.", "embedding.position_embeddings.", "decoder.layers.", "decoder.final_layernorm.",
     "output_layer."), _LAYER)
ORDERS = {
    "gpt": DECODER_ONLY_ORDER,
    "llama": DECODER_ONLY_ORDER,
    "mixtral": ParameterOrder(DECODER_ONLY_ORDER.parts, (*_LAYER[:4], "mlp.router.", "mlp.experts.")),
    "bert": ParameterOrder(
        ("embedding.word_embeddings.", "embedding.position_embeddings.", "embedding.tokentype_embeddings.",
         "encoder.layers.", "encoder.final_layernorm.", "lm_head.dense.", "lm_head.layer_norm.", "output_layer.",
         "binary_head.", "pooler.dense."), _LAYER),
    "t5": ParameterOrder(
        ("embedding.word_embeddings.", "embedding.position_embeddings.", "encoder_relative_pos_emb.",
         "decoder_relative_pos_emb.", "encoder.layers.", "encoder.final_layernorm.", "decoder.layers.",
         "decoder.final_layernorm.", "lm_head.output_layer."),
        ("input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.", "pre_cross_attn_layernorm.",
         "cross_attention.linear_proj.", "cross_attention.linear_q.", "cross_attention.linear_kv.",
         "pre_mlp_layernorm.", "mlp.linear_fc1.", "mlp.linear_fc2.")),
}


def _position(key: str, order: tuple[str, ...], what: str) -> int:
    for position, prefix in enumerate(order):
        if key.startswith(prefix):
            return position
    raise ConversionError(f"{what} {key!r} has no place in megatron-core's parameter order mega knows")


def no_weight_decay(key: str, tensor: torch.Tensor) -> bool:
    """megatron-core's standard override: biases and 1-D parameters are not weight-decayed."""
    return key.endswith(".bias") or tensor.dim() == 1


def _groups_in_order(parameters: list[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str]]:
    decayed = [key for key, tensor in parameters if not no_weight_decay(key, tensor)]
    plain = [key for key, tensor in parameters if no_weight_decay(key, tensor)]
    return decayed, plain


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
    decayed, plain = _groups_in_order(parameters)
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
    for group, keys in zip(param_groups(optimizer), _groups_in_order(parameters), strict=True):
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


def chained_parts(saved, parameters: list[tuple[str, torch.Tensor]], is_expert, where: str) -> list[tuple]:
    """(optimizer state, its parameters) of each optimizer a rank file's ``saved`` entry holds: one,
    or megatron-core's chained pair under expert parallelism (a list: the dense parameters'
    optimizer, then the experts', ``is_expert(key)``)."""
    if not isinstance(saved, list):
        return [(saved, parameters)]
    if len(saved) != 2:
        raise ConversionError(f"{where} holds {len(saved)} optimizers' state; megatron-core's chained optimizer of "
                              "a mixture of experts holds two (the dense parameters', the experts')")
    dense = [item for item in parameters if not is_expert(item[0])]
    experts = [item for item in parameters if is_expert(item[0])]
    return [(saved[0], dense), (saved[1], experts)]
