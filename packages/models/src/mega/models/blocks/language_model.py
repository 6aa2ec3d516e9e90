"""``LanguageModel``: the part of a decoder-only LM that one pipeline stage (or chunk) holds.

Parameter names are Megatron-Core's (local, non-Transformer-Engine spec), with the global layer
number in ``decoder.layers.N``, so checkpoints of any layout map onto each other 1:1:

    embedding.word_embeddings.weight          embedding.position_embeddings.weight (learned)
    decoder.layers.N.input_layernorm.{weight,bias}
    decoder.layers.N.self_attention.linear_qkv.{weight,bias}
    decoder.layers.N.self_attention.linear_proj.{weight,bias}
    decoder.layers.N.pre_mlp_layernorm.{weight,bias}
    decoder.layers.N.mlp.linear_fc1.{weight,bias}   decoder.layers.N.mlp.linear_fc2.{weight,bias}
    decoder.final_layernorm.{weight,bias}     output_layer.weight (untied only)

With tied embeddings ``output_layer`` uses the word embedding's parameter itself; a last stage
that is not also the first holds a copy of it under the same name (see
:mod:`mega.models.blocks.tied_embedding`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch
from torch import nn

from mega.core.kernels import CAUSAL, AttentionMask, Kernels, check_linear_loss
from mega.core.model_family import ParallelContext, Stage
from mega.core.parallel import ParallelConfig
from mega.core.parallel.output_layer_loss import (
    output_layer_cross_entropy,
    output_layer_defers,
    rebuildable_input,
)
from mega.core.parallel.param_attrs import mark_padded_vocab
from mega.models.blocks import fusions
from mega.models.blocks.block import transformer_block
from mega.models.blocks.embedding import Embedding
from mega.models.blocks.kv_cache import KVCache
from mega.models.blocks.layer_stack import check_layers
from mega.models.blocks.mla import mla_cos_sin
from mega.models.blocks.packed_sequences import document_attention_mask
from mega.models.blocks.rope import model_rotary_angles, rotary_cos_sin
from mega.models.blocks.tied_embedding import stage_embedding, tie_output_layer
from mega.models.config import TransformerConfig


class LanguageModel(nn.Module):
    """``stage``: which layers (``stage.layers["decoder"]``) and whether the embeddings (first
    stage) and the output layer (last stage) are held; ``parallel``: the layout the vocabulary
    is padded for; ``kernels``: where the components come from; ``context``: the layout its
    modules take at construction (groups, sequence parallelism, dropout stream; None: one device)."""

    def __init__(self, config: TransformerConfig, stage: Stage, kernels: Kernels, parallel: ParallelConfig,
                 context: ParallelContext | None = None):
        super().__init__()
        config.validate(parallel.tp)
        layers = stage.layers["decoder"]
        check_layers(layers, config.num_layers)
        pre_process, post_process = stage.is_first, stage.is_last
        self.config, self.stage, self.pre_process, self.post_process = config, stage, pre_process, post_process
        self.tied = not config.untie_embeddings_and_output_weights
        self.kernels = kernels
        vocab = config.padded_vocab_size(parallel.tp)

        self.embedding = stage_embedding(partial(Embedding, config, vocab), stage, self.tied)
        self.decoder = self.decoder_block(config, layers, post_process, kernels, context)
        # A backend that fuses the output layer into the loss: the last stage then hands the loss
        # its final hidden states and the output weight instead of logits (see forward).
        self.fused_loss = kernels.get("linear_loss") is not None if post_process else False
        if self.fused_loss:
            check_linear_loss(kernels, parallel.tp)
        if post_process:
            self.output_layer = kernels.linear(config.hidden_size, vocab, bias=False)
            mark_padded_vocab(self.output_layer.weight)
            if self.tied:
                tie_output_layer(self, self.output_layer, "output_layer.weight")

    def forward(self, inputs: torch.Tensor | Mapping[str, torch.Tensor], position_ids: torch.Tensor | None = None,
                inference_cache: KVCache | None = None, logits_to_keep: int | torch.Tensor | None = None,
                mask: AttentionMask = CAUSAL):
        """Token ids ``[b, s]`` on the first stage, hidden ``[s, b, h]`` after; returns hidden
        ``[s, b, h]``, or logits ``[s, b, vocab (shard)]`` on the last stage.

        In a pipeline (``inputs`` a dict, see :mod:`mega.core.model_family`) the first stage
        reads ``tokens`` (and ``position_ids``), later ones ``hidden``; the result is
        ``{"hidden": ...}`` or, on the last stage, ``{"logits": ...}``; with a fused
        ``linear_loss`` kernel the last stage returns ``{"output_hidden": [s, b, h], "output_weight":
        the output layer's weight}`` instead, and the loss applies both (no logits tensor); so it
        does where a zero-bubble schedule defers the output layer's weight gradient to W (the
        hidden after the layer's input collective: the loss's W rebuilds the logits' gradient).

        ``inference_cache`` (generation, :mod:`mega.models.blocks.kv_cache`): the inputs continue the
        cached positions; ``position_ids`` then default to those that follow the cache.
        ``logits_to_keep``: the last stage computes the logits of the last N positions only
        (generation needs the next token's; the vocabulary projection dominates short models), or,
        given a tensor ``[b]`` of positions, of that one position per row (right-padded prompts
        prefilled together each end at their own position): logits ``[1, b, vocab]``.
        ``mask``: which keys each query sees (causal; packed rows: within each document, from the
        batch's ``document_ids``, :mod:`mega.models.blocks.packed_sequences`).
        """
        if isinstance(inputs, Mapping):
            hidden = inputs["tokens"] if self.pre_process else inputs["hidden"]
            mask = document_attention_mask(inputs.get("document_ids"))  # packed rows: each document alone
            if self.post_process and (self.fused_loss or output_layer_defers(self.output_layer.weight)):
                # The loss applies the output layer: a linear_loss kernel's, or (a zero-bubble
                # schedule's forward) one whose W rebuilds the logits' gradient (output_layer_loss).
                hidden = self._final_hidden(hidden, inputs.get("position_ids"), mask=mask)
                given = hidden if self.fused_loss else rebuildable_input(self.output_layer, hidden)
                if given is not None:
                    return {"output_hidden": given, "output_weight": self.output_layer.weight}
                return {"logits": self.output_layer(hidden)}
            output = self.forward(hidden, inputs.get("position_ids"), mask=mask)
            return {"logits" if self.post_process else "hidden": output}
        if inference_cache is not None and position_ids is None:
            seq = inputs.shape[1] if self.pre_process else inputs.shape[0]
            start = inference_cache.length
            position_ids = torch.arange(start, start + seq, device=inputs.device)[None, :]
        hidden = self._final_hidden(inputs, position_ids, inference_cache, mask)
        if not self.post_process:
            return hidden
        if isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[logits_to_keep, torch.arange(hidden.shape[1], device=hidden.device)][None]
        elif logits_to_keep:
            hidden = hidden[-logits_to_keep:]
        return self.output_layer(hidden)

    def _final_hidden(self, inputs: torch.Tensor, position_ids: torch.Tensor | None,
                      inference_cache: KVCache | None = None, mask: AttentionMask = CAUSAL) -> torch.Tensor:
        """The decoder's output ``[s, b, h]`` (after the final norm on the last stage)."""
        hidden = self.embedding(inputs, position_ids) if self.pre_process else inputs
        layer_kwargs = {} if mask is CAUSAL else {"mask": mask}  # causal: the layers' default
        cos_sin = self.rotary_cos_sin()
        if cos_sin is not None:  # RoPE's angles, the same in every layer: made once per forward
            seq = inputs.shape[1] if self.pre_process else inputs.shape[0]
            layer_kwargs["rotary_angles"] = model_rotary_angles(self.config, cos_sin, seq, position_ids,
                                                                hidden.device, hidden.dtype)
        return self.decoder(hidden, position_ids, cache=inference_cache, **layer_kwargs)


    def decoder_block(self, config: TransformerConfig, layers: range, final_norm: bool, kernels: Kernels,
                      context: ParallelContext | None) -> nn.Module:
        """This stage's decoder layers and final norm (a family with layers of its own overrides it)."""
        return transformer_block(config, layers, final_norm, kernels, context)

    def rotary_cos_sin(self):
        """The function making the layers' RoPE angles once per forward (None: no RoPE)."""
        return rotary_cos_sin_of(self.config)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, tp_group=None) -> torch.Tensor:
        """Per-token cross-entropy ``[b, s]`` (fp32) of logits ``[s, b, vocab (shard)]``; the
        padded vocabulary rows take no part."""
        return per_token_cross_entropy(self.kernels, logits, labels, tp_group, self.config.vocab_size)


def rotary_cos_sin_of(config: TransformerConfig):
    """The function that makes the layers' RoPE angles (multi-latent attention's, with YaRN where
    configured, or the plain one), or None for a model without rotary positions."""
    if getattr(config, "multi_latent_attention", False):
        return mla_cos_sin
    return rotary_cos_sin if config.position_embedding_type == "rope" else None


def per_token_cross_entropy(kernels: Kernels, logits: torch.Tensor, labels: torch.Tensor, tp_group=None,
                            vocab_size: int | None = None, fused: bool = False) -> torch.Tensor:
    """``[b, s]`` cross-entropy of logits ``[s, b, vocab (shard over tp_group)]`` against labels ``[b, s]``
    from the selected loss kernel, over the first ``vocab_size`` rows (the rest is padding);
    ``fused`` (--cross-entropy-loss-fusion) computes torch's loss as one kernel where the
    vocabulary is held whole."""
    whole = tp_group is None or tp_group.size == 1
    if fused and whole and vocab_size is not None and kernels.selection.get("loss") == "torch":
        return fusions.cross_entropy(logits, labels.transpose(0, 1), vocab_size).transpose(0, 1)
    return kernels.loss(logits, labels.transpose(0, 1), tp_group, vocab_size).transpose(0, 1)


def fused_linear_cross_entropy(kernels: Kernels, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               loss_mask: torch.Tensor, tp_group=None, vocab_size: int | None = None) -> torch.Tensor:
    """The fp32 sum of ``loss_mask`` x cross-entropy of hidden ``[s, b, h]`` through the output
    ``weight`` against labels ``[b, s]``, from the selected ``linear_loss`` kernel (no logits), or
    without one (a zero-bubble schedule's last stage) from the output layer and cross-entropy whose
    W rebuilds the logits' gradient."""
    tokens = hidden.reshape(-1, hidden.shape[-1])  # [s * b, h], s-major like the labels below
    labels, loss_mask = labels.t().reshape(-1), loss_mask.t().reshape(-1)
    component = kernels.get("linear_loss")
    if component is not None:
        return component(tokens, weight, labels, loss_mask, tp_group, vocab_size)
    return (output_layer_cross_entropy(tokens, weight, labels, tp_group, vocab_size) * loss_mask).sum()

