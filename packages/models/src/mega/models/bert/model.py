"""``BertModel``: the part of a BERT encoder that one pipeline stage (or chunk) holds.

Hugging Face's ``BertForPreTraining`` computed the Megatron way (``[seq, batch, hidden]``,
fused QKV per head, parallel layers swapped in from outside). Parameter names are
Megatron-Core's ``BertModel``'s where it has the module; its layers are pre-LN, BERT's are
post-LN, so the two norms of a layer and the embedding's norm have names of their own:

    embedding.word_embeddings.weight   embedding.position_embeddings.weight
    embedding.tokentype_embeddings.weight   embedding.layernorm.{weight,bias}
    encoder.layers.N.self_attention.linear_qkv.{weight,bias}   ...linear_proj.{weight,bias}
    encoder.layers.N.post_self_attn_layernorm.{weight,bias}
    encoder.layers.N.mlp.linear_fc1.{weight,bias}   encoder.layers.N.mlp.linear_fc2.{weight,bias}
    encoder.layers.N.post_mlp_layernorm.{weight,bias}
    lm_head.dense.{weight,bias}   lm_head.layer_norm.{weight,bias}   output_layer.bias
    pooler.dense.{weight,bias}   binary_head.{weight,bias}            (with the binary head)

With ``bert_pre_layernorm`` the model is megatron-core's ``BertModel`` under its names: no
``embedding.layernorm``; ``encoder.layers.N.input_layernorm`` and ``...pre_mlp_layernorm`` before
attention and the MLP; ``encoder.final_layernorm`` after the last layer.

The masked-LM decoder is the word embedding (tied; a later pipeline stage holds a copy, synced
as GPT's is) with a bias of its own over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch
from torch import nn

from mega.core.kernels import AttentionMask, Kernels
from mega.core.model_family import ParallelContext, Stage
from mega.core.parallel import ParallelConfig
from mega.core.parallel.collectives import gather_from_sequence_parallel_region
from mega.core.parallel.param_attrs import mark_padded_vocab
from mega.models.bert.config import BertConfig
from mega.models.blocks.attention import SelfAttention
from mega.models.blocks.block import TransformerLayer
from mega.models.blocks.layer_stack import LayerStack, check_layers
from mega.models.blocks.mlp import MLP
from mega.models.blocks.norms import build_norm
from mega.models.blocks.tied_embedding import stage_embedding, tie_output_layer
from mega.models.config import ModelConfigError


def padding_attention_mask(padding_mask: torch.Tensor | None) -> AttentionMask:
    """Every query sees every real key: ``padding_mask`` ``[batch, seq]`` is 1 at real tokens."""
    return AttentionMask(padding=None if padding_mask is None else padding_mask > 0)


class BertEmbedding(nn.Module):
    """LayerNorm(word + token type + position) (no norm when pre-LN), then dropout; returns
    ``[seq, batch, hidden]``.

    ``words_only``: a later pipeline stage's copy of the word embedding, the MLM decoder's weight.
    """

    def __init__(self, config: BertConfig, padded_vocab_size: int, kernels: Kernels, words_only: bool = False):
        super().__init__()
        self.word_embeddings = nn.Embedding(padded_vocab_size, config.hidden_size)
        mark_padded_vocab(self.word_embeddings.weight)
        if words_only:
            return
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.tokentype_embeddings = (nn.Embedding(config.num_tokentypes, config.hidden_size)
                                     if config.num_tokentypes > 0 else None)
        self.layernorm = None if config.bert_pre_layernorm else build_norm(config, kernels)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, text: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.word_embeddings(text)  # [b, s, h]
        if self.tokentype_embeddings is not None:
            types = types if types is not None else torch.zeros_like(text)
            hidden = hidden + self.tokentype_embeddings(types)
        positions = torch.arange(text.shape[1], device=text.device)[None, :]
        hidden = hidden + self.position_embeddings(positions)
        if self.layernorm is not None:
            hidden = self.layernorm(hidden)
        return self.dropout(hidden.transpose(0, 1).contiguous())


class BertLayer(nn.Module):
    """x = norm(x + dropout(attention(x))), then x = norm(x + dropout(mlp(x))): post-LN."""

    def __init__(self, config: BertConfig, kernels: Kernels, context: ParallelContext | None = None):
        super().__init__()
        self.self_attention = SelfAttention(config, kernels, context)
        self.post_self_attn_layernorm = build_norm(config, kernels)
        self.mlp = MLP(config, kernels)
        self.post_mlp_layernorm = build_norm(config, kernels)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        attention = self.self_attention(hidden, mask=mask)
        hidden = self.post_self_attn_layernorm(hidden + self.hidden_dropout(attention))
        return self.post_mlp_layernorm(hidden + self.hidden_dropout(self.mlp(hidden)))


def bert_encoder(config: BertConfig, layer_numbers: range, kernels: Kernels,
                 context: ParallelContext | None = None) -> LayerStack:
    """The layers numbered ``layer_numbers`` (global numbers: ``encoder.layers.N``), called with
    the hidden state and ``mask=``. Post-LN layers each end in a norm; pre-LN ones (megatron-core's
    transformer layer) are followed by ``final_layernorm`` on the stage holding the last layer."""
    layer_class = TransformerLayer if config.bert_pre_layernorm else BertLayer
    layers = {number: layer_class(config, kernels, context=context) for number in layer_numbers}
    last = config.bert_pre_layernorm and layer_numbers.stop == config.num_layers
    stream = context.stack_dropout_tracker if context is not None else None
    return LayerStack(layers, build_norm(config, kernels) if last else None, rng_stream=stream)


class BertLMHead(nn.Module):
    """The masked-LM transform: LayerNorm(gelu(dense(x))), before the tied decoder."""

    def __init__(self, config: BertConfig, kernels: Kernels):
        super().__init__()
        self.dense = kernels.linear(config.hidden_size, config.hidden_size, bias=True)
        self.activation = kernels.activation("gelu_tanh" if config.openai_gelu else "gelu")
        self.layer_norm = build_norm(config, kernels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(self.activation(self.dense(hidden)))


class Pooler(nn.Module):
    """tanh(dense(hidden of the first token)): the binary head's input.

    Under sequence parallelism the first token lives on one rank, so the sequence is gathered
    first (``sequence_parallel_group``, the tensor group from the construction ``context``) and every rank computes the same
    pooler; the gathered tensor's gradient is split back, not summed, for the same reason.
    """

    def __init__(self, config: BertConfig, kernels: Kernels, context: ParallelContext | None = None):
        super().__init__()
        self.dense = kernels.linear(config.hidden_size, config.hidden_size, bias=True)
        groups = context.groups if context is not None and context.sequence_parallel else None
        self.sequence_parallel_group = groups.tp if groups is not None and groups.tp.size > 1 else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel_group is not None:
            hidden = gather_from_sequence_parallel_region(hidden, self.sequence_parallel_group,
                                                          tensor_parallel_output_grad=False)
        return torch.tanh(self.dense(hidden[0]))


class BertModel(nn.Module):
    """``stage``: which layers (``stage.layers["encoder"]``), and whether the embeddings (first
    stage) and the heads (last stage) are held; ``parallel``: the layout the vocabulary is
    padded for; ``kernels``: where the components come from."""

    def __init__(self, config: BertConfig, stage: Stage, kernels: Kernels, parallel: ParallelConfig,
                 context: ParallelContext | None = None):
        super().__init__()
        config.validate(parallel.tp)
        if kernels.get("norm_linear") is not None or kernels.get("norm_mlp") is not None:
            raise ModelConfigError("BERT's layers build their norms on their own (post-LN ones have no norm "
                                   "feeding a linear layer), so norm_linear / norm_mlp kernel backends cannot be "
                                   "used (choose --normalization-backend instead)")
        layers = stage.layers["encoder"]
        check_layers(layers, config.num_layers)
        pre_process, post_process = stage.is_first, stage.is_last
        self.config, self.stage, self.pre_process, self.post_process = config, stage, pre_process, post_process
        self.kernels = kernels
        tied = not config.untie_embeddings_and_output_weights
        vocab = config.padded_vocab_size(parallel.tp)

        self.embedding = stage_embedding(partial(BertEmbedding, config, vocab, kernels), stage, tied)
        self.encoder = bert_encoder(config, layers, kernels, context)
        if not post_process:
            return
        self.lm_head = BertLMHead(config, kernels)
        self.output_layer = kernels.linear(config.hidden_size, vocab, bias=True)
        mark_padded_vocab(self.output_layer.weight)
        mark_padded_vocab(self.output_layer.bias)
        if tied:
            tie_output_layer(self, self.output_layer, "output_layer.weight")
        if config.bert_binary_head:
            self.pooler = Pooler(config, kernels, context)
            self.binary_head = kernels.linear(config.hidden_size, 2, bias=True)

    def encode(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This stage's encoder output ``[seq, batch, hidden]`` (of the last layer on the last
        stage: what ``BertModel`` calls ``last_hidden_state``, transposed). The first stage
        reads ``text`` (and ``types``), later ones ``hidden``; every stage ``padding_mask``."""
        mask = padding_attention_mask(batch.get("padding_mask"))
        hidden = self.embedding(batch["text"], batch.get("types")) if self.pre_process else batch["hidden"]
        return self.encoder(hidden, mask=mask)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{"hidden"}`` to send on, or on the last stage ``{"logits"}`` ``[seq, batch, vocab
        (shard)]`` and, with the binary head, ``{"binary_logits"}`` ``[batch, 2]``."""
        hidden = self.encode(batch)
        if not self.post_process:
            return {"hidden": hidden}
        outputs = {"logits": self.output_layer(self.lm_head(hidden))}
        if self.config.bert_binary_head:
            outputs["binary_logits"] = self.binary_head(self.pooler(hidden))
        return outputs
