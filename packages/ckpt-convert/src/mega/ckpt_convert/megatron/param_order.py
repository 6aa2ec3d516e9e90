"""megatron-core's parameter order and param groups, which index a rank's optimizer state.

megatron-core numbers a rank's parameters group by group (``_get_param_groups``: the weight-decayed
ones, then biases and 1-D parameters, the group whose ``wd_mult`` is 0), each group in the model's
registration order (:data:`ORDERS`, per family).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.megatron.names import split_stack_layer
from mega.ckpt_convert.optimizer_state import OptimizerState


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


def groups_in_order(parameters: list[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str]]:
    decayed = [key for key, tensor in parameters if not no_weight_decay(key, tensor)]
    plain = [key for key, tensor in parameters if no_weight_decay(key, tensor)]
    return decayed, plain


def param_groups(state: OptimizerState) -> list[dict]:
    """Megatron-core's two default param groups (weight-decayed, and not: biases and norms),
    identified by the keys its ``_filter_and_reorder_param_groups`` matches; the hyperparameters
    are the run's (Megatron's scheduler sets lr and weight decay every step anyway)."""
    hyper = state.hyperparameters
    common = dict(is_expert_parallel=False, default_config=True, lr_mult=1.0, is_decoupled_lr=False,
                  lr=float(hyper.get("lr", 0.0)), max_lr=float(hyper.get("lr", 0.0)), min_lr=None,
                  betas=tuple(hyper.get("betas", (0.9, 0.999))), eps=float(hyper.get("eps", 1e-8)),
                  weight_decay=float(hyper.get("weight_decay", 0.0)), amsgrad=False, maximize=False,
                  foreach=None, capturable=False, differentiable=False, fused=None, decoupled_weight_decay=True)
    return [dict(common, wd_mult=1.0), dict(common, wd_mult=0.0)]
