"""``T5Model``: the part of an encoder-decoder T5 that one pipeline stage holds.

Parameter names are Megatron-Core's T5 names (local spec):

    embedding.word_embeddings.weight                  (shared by encoder and decoder inputs)
    embedding.position_embeddings.weight              (learned absolute positions: shared too)
    encoder_relative_pos_emb.relative_attention_bias.weight   decoder_relative_pos_emb....  (relative)
    encoder.layers.N.{input_layernorm, self_attention.linear_qkv, self_attention.linear_proj,
                      pre_mlp_layernorm, mlp.linear_fc1, mlp.linear_fc2}.weight
    decoder.layers.N.{... as the encoder ..., pre_cross_attn_layernorm,
                      cross_attention.linear_q, cross_attention.linear_kv, cross_attention.linear_proj}.weight
    encoder.final_layernorm.weight   decoder.final_layernorm.weight
    (and ``.bias`` of each norm with LayerNorm, of each linear layer with --add-bias-linear)
    lm_head.output_layer.weight      (untied only; tied, the word embedding, scaled by d_model**-0.5)
    lm_head.output_layer.bias        (with --output-layer-bias, as Megatron-Core's tied T5)

A stage holds ``stage.layers["encoder"]`` and ``stage.layers["decoder"]`` (either may be empty),
visited in that order. What crosses to the next stage (:mod:`mega.models.t5.stages`): while the
encoder runs, its hidden state, its relative-position bias (if relative) and the embedded decoder inputs (the
first stage embeds both, so one word embedding serves both stacks without a third tied copy);
once it has run, the encoder's output (carried to every decoder stage, each of whose layers
cross-attends to it) and the decoder's hidden state and bias.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch
from torch import nn

from mega.core.kernels import AttentionMask, Kernels
from mega.core.model_family import ParallelContext, Stage
from mega.core.parallel import ParallelConfig
from mega.core.parallel.param_attrs import mark_padded_vocab
from mega.models.blocks.embedding import Embedding
from mega.models.blocks.kv_cache import KVCache, LayerKVCache
from mega.models.blocks.layer_stack import LayerStack, check_layers
from mega.models.blocks.norms import build_norm
from mega.models.blocks.tied_embedding import stage_embedding, tie_output_layer
from mega.models.t5.config import T5Config
from mega.models.t5.layers import DecoderLayer, EncoderLayer
from mega.models.t5.relative_position import RelativePositionBias


class LMHead(nn.Module):
    """The output layer; tied to the word embedding, T5 scales its input by ``d_model**-0.5`` first
    (``scale_tied_output``). Megatron-Core's T5 does not, and gives a tied output layer a bias."""

    def __init__(self, config: T5Config, kernels: Kernels, vocab: int):
        super().__init__()
        self.output_layer = kernels.linear(config.hidden_size, vocab, bias=config.output_layer_bias)
        mark_padded_vocab(self.output_layer.weight)
        if config.output_layer_bias:
            mark_padded_vocab(self.output_layer.bias)
        tied = not config.untie_embeddings_and_output_weights
        self.scale = config.hidden_size ** -0.5 if tied and config.scale_tied_output else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output_layer(hidden * self.scale if self.scale is not None else hidden)


def t5_stack(config: T5Config, layer_class: type[nn.Module], layer_numbers: range, num_layers: int,
             kernels: Kernels, context: ParallelContext | None = None) -> LayerStack:
    """The layers ``layer_numbers`` of one stack (global numbers in the names), and its final norm
    and dropout when the last layer is among them. Under sequence parallelism the stack keeps
    drawing dropout from the default stream, where Megatron-Core forks it into the model-parallel one."""
    layers = {number: layer_class(config, kernels, context) for number in layer_numbers}
    final_norm = build_norm(config, kernels) if layer_numbers.stop == num_layers else None
    return LayerStack(layers, final_norm, final_dropout=config.hidden_dropout)


class T5Model(nn.Module):
    def __init__(self, config: T5Config, stage: Stage, kernels: Kernels, parallel: ParallelConfig,
                 context: ParallelContext | None = None):
        super().__init__()
        config.validate(parallel.tp)
        self.config, self.stage, self.kernels = config, stage, kernels
        self.encoder_layers = stage.layers.get("encoder", range(0))
        self.decoder_layers = stage.layers.get("decoder", range(0))
        check_layers(self.encoder_layers, config.num_layers, "encoder")
        check_layers(self.decoder_layers, config.decoder_num_layers, "decoder")
        self.pre_process, self.post_process = stage.is_first, stage.is_last
        self.tied = not config.untie_embeddings_and_output_weights
        vocab = config.padded_vocab_size(parallel.tp)
        self.embedding = stage_embedding(partial(Embedding, config, vocab), stage, self.tied)

        buckets = config.relative_attention_num_buckets, config.relative_attention_max_distance
        heads = config.num_attention_heads
        if config.relative and 0 in self.encoder_layers:
            self.encoder_relative_pos_emb = RelativePositionBias(*buckets, heads, bidirectional=True)
        if self.encoder_layers:
            self.encoder = t5_stack(config, EncoderLayer, self.encoder_layers, config.num_layers, kernels, context)
        if config.relative and 0 in self.decoder_layers:
            self.decoder_relative_pos_emb = RelativePositionBias(*buckets, heads, bidirectional=False)
        if self.decoder_layers:
            self.decoder = t5_stack(config, DecoderLayer, self.decoder_layers, config.decoder_num_layers, kernels,
                                    context)
        if self.post_process:
            self.lm_head = LMHead(config, kernels, vocab)
            if self.tied:
                tie_output_layer(self, self.lm_head.output_layer, "lm_head.output_layer.weight")

    # -- training (the pipeline's dict interface) ------------------------------------------------
    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The micro-batch (``text_enc``, ``text_dec``, ``enc_mask``, ``dec_mask``) and what crossed
        in -> what crosses out, or ``{"logits": [decoder seq, b, vocab (shard)]}`` on the last stage."""
        state = dict(inputs)
        if self.pre_process:
            state["encoder_hidden"] = self.embedding(inputs["text_enc"])
            state["decoder_hidden"] = self.embedding(inputs["text_dec"])
        encoder_padding = inputs["enc_mask"]
        relative = self.config.relative
        if self.encoder_layers:
            if relative and "encoder_bias" not in state:
                seq = encoder_padding.shape[1]
                state["encoder_bias"] = self.encoder_relative_pos_emb(seq, seq)
            mask = AttentionMask(padding=encoder_padding, bias=state.get("encoder_bias"))
            hidden = self.encoder(state.pop("encoder_hidden"), mask)
            if self.encoder.final_layernorm is not None:  # the encoder's last layer: its output is final
                state["encoder_output"] = hidden
                state.pop("encoder_bias", None)
            else:
                state["encoder_hidden"] = hidden
        if self.decoder_layers:
            decoder_padding = inputs["dec_mask"]
            if relative and "decoder_bias" not in state:
                seq = decoder_padding.shape[1]
                state["decoder_bias"] = self.decoder_relative_pos_emb(seq, seq)
            self_mask = AttentionMask(causal=True, padding=decoder_padding, bias=state.get("decoder_bias"))
            cross_mask = AttentionMask(padding=encoder_padding)
            state["decoder_hidden"] = self.decoder(state["decoder_hidden"], state["encoder_output"], self_mask,
                                                   cross_mask)
        if self.post_process:  # the decoder's last layer, its final norm applied
            return {"logits": self.lm_head(state["decoder_hidden"])}
        return {name: state[name] for name in BOUNDARY_NAMES if name in state}

    # -- generation ------------------------------------------------------------------------------
    def encode(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """Encoder output ``[s, b, h]`` of ``tokens`` ``[b, s]`` (``padding`` True at real tokens)."""
        seq = tokens.shape[1]
        bias = self.encoder_relative_pos_emb(seq, seq) if self.config.relative else None
        mask = AttentionMask(padding=padding, bias=bias)
        return self.encoder(self.embedding(tokens), mask)

    def decode(self, tokens: torch.Tensor, encoder_output: torch.Tensor, encoder_padding: torch.Tensor,
               cache: DecoderCache, logits_to_keep: int | None = None) -> torch.Tensor:
        """Logits ``[s (or logits_to_keep), b, vocab (shard)]`` of decoder ``tokens`` ``[b, s]``
        continuing the ``cache``d positions."""
        seq, start = tokens.shape[1], cache.length
        bias = self.decoder_relative_pos_emb(seq, start + seq, query_offset=start) if self.config.relative else None
        self_mask = AttentionMask(causal=True, bias=bias)
        cross_mask = AttentionMask(padding=encoder_padding)
        positions = torch.arange(start, start + seq, device=tokens.device)[None, :]
        hidden = self.decoder(self.embedding(tokens, positions), encoder_output, self_mask, cross_mask, cache=cache)
        return self.lm_head(hidden[-logits_to_keep:] if logits_to_keep else hidden)


BOUNDARY_NAMES = ("encoder_hidden", "encoder_bias", "encoder_output", "decoder_hidden", "decoder_bias")


class DecoderLayerCache(LayerKVCache):
    """A decoder layer's self-attention keys and values, and its cross-attention's keys and values
    of the encoder output (``cross``, computed on the first step)."""

    def __init__(self, max_length: int):
        super().__init__(max_length)
        self.cross: tuple[torch.Tensor, torch.Tensor] | None = None

    def keep(self, rows: torch.Tensor) -> None:
        super().keep(rows)
        if self.cross is not None:
            # The cross keys/values are [s, b, heads, d]: the batch is dimension 1.
            self.cross = tuple(t[:, rows] for t in self.cross)


class DecoderCache(KVCache):
    def layer(self, number: int) -> DecoderLayerCache:
        cache = self._layers.get(number)
        if cache is None:
            cache = self._layers[number] = DecoderLayerCache(self.max_length)
        return cache

