"""The ``t5`` family: build a stage, make it parallel, start its parameters, count and describe it.

Presets are Google's T5 shapes (Raffel et al. 2020; Hugging Face ``t5-small``/``t5-base``/
``t5-large``, ``google/t5-v1_1-base``) with Megatron's T5 sequence lengths (512 encoder, 128
decoder) and the 32128-token SentencePiece vocabulary (100 sentinels included).
"""

from __future__ import annotations

import torch
from torch import nn

from mega.core.kernels import Kernels
from mega.core.model_family import LossContext, ModelFamily, ParallelContext, Stage
from mega.core.parallel import ParallelConfig
from mega.core.parallel.groups import Group
from mega.core.parallel.param_attrs import mark_tensor_parallel
from mega.core.parallel.plan import Colwise, PlanStyle, Rowwise, SequenceParallelOutput, VocabEmbedding
from mega.core.parallel.tensor_parallel import apply_tensor_parallel
from mega.core.setup_passes import ModelSetup, Phase, per_chunk
from mega.models.family import language_model_loss
from mega.models.initialization import init_parameter
from mega.models.t5.config import T5Config
from mega.models.t5.hf_t5 import T5_MAPPING
from mega.models.t5.model import T5Model
from mega.models.t5.stages import boundary, pipeline_stages

BATCH_KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask")


def t5_config(num_layers: int, hidden_size: int, num_attention_heads: int, ffn_hidden_size: int,
              **overrides) -> T5Config:
    settings = dict(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                    ffn_hidden_size=ffn_hidden_size, kv_channels=64, seq_length=512, decoder_seq_length=128,
                    vocab_size=32128)
    return T5Config(**{**settings, **overrides})


PRESETS = {
    "tiny": t5_config(2, 64, 4, 256, kv_channels=16, seq_length=64, decoder_seq_length=32, vocab_size=512),
    "small": t5_config(6, 512, 8, 2048),
    "base": t5_config(12, 768, 12, 3072),
    "large": t5_config(24, 1024, 16, 4096),
    "v1_1-base": t5_config(12, 768, 12, 2048, feed_forward_proj="gated-gelu", untie_embeddings_and_output_weights=True),
}


def build_t5(config: T5Config, stage: Stage, *, kernels: Kernels, parallel: ParallelConfig,
             context: ParallelContext | None = None) -> T5Model:
    return T5Model(config, stage, kernels, parallel, context)


def tensor_parallel_plan(config: T5Config, stage: Stage) -> dict[str, PlanStyle]:
    """Megatron's split: QKV, Q, KV and fc1 column-parallel (whole heads; gated-GELU's gate and up
    each split on their own), output projections row-parallel, the vocabulary split; the
    sequence-parallel region starts after the embeddings."""
    plan: dict[str, PlanStyle] = {}
    tied = not config.untie_embeddings_and_output_weights
    if stage.is_first or (stage.is_last and tied):
        plan["embedding"] = SequenceParallelOutput()
        plan["embedding.word_embeddings"] = VocabEmbedding()
    for stack in ("encoder", "decoder"):
        if not stage.layers[stack]:
            continue
        layers = f"{stack}.layers.*."
        plan[layers + "self_attention.linear_qkv"] = Colwise()
        plan[layers + "self_attention.linear_proj"] = Rowwise()
        plan[layers + "mlp.linear_fc1"] = Colwise(chunks=2 if config.gated else 1)
        plan[layers + "mlp.linear_fc2"] = Rowwise()
    if stage.layers["decoder"]:
        plan["decoder.layers.*.cross_attention.linear_q"] = Colwise()
        plan["decoder.layers.*.cross_attention.linear_kv"] = Colwise()
        plan["decoder.layers.*.cross_attention.linear_proj"] = Rowwise()
    if stage.is_last:
        plan["lm_head.output_layer"] = Colwise()
    return plan


def parallelize_t5(model: T5Model, setup: ModelSetup) -> None:
    """T5's one setup pass (tensor parallel): the relative-position tables split by heads
    (before the plan, so sequence parallelism does not take them for replicated weights), then
    the plan. T5 has no recompute or context-parallel flags; its attention cores take their
    dropout stream at construction (``context``)."""
    shard_relative_position_tables(model, setup.groups.tp)
    apply_tensor_parallel(model, tensor_parallel_plan(setup.config, model.stage), setup.groups,
                          sequence_parallel=setup.parallel.sequence_parallel)


T5_PASSES = (per_chunk("tensor-parallel", Phase.TENSOR_PARALLEL, parallelize_t5,
                       "T5's relative-position tables by heads, its tensor plan"),)


def shard_relative_position_tables(model: T5Model, tp: Group) -> None:
    """Keep this rank's heads (columns) of each relative-position table the stage holds."""
    if tp.size <= 1:
        return
    for name in ("encoder_relative_pos_emb", "decoder_relative_pos_emb"):
        table = getattr(model, name, None)
        if table is not None:
            weight = table.relative_attention_bias.weight
            heads = weight.shape[1] // tp.size
            shard = nn.Parameter(weight.detach()[:, tp.rank * heads:(tp.rank + 1) * heads].clone())
            mark_tensor_parallel(shard, dim=1)
            table.relative_attention_bias.weight = shard


def t5_loss(outputs, batch, context: LossContext):
    """Mean cross-entropy of the decoder's predictions over the tokens ``loss_mask`` keeps,
    logged as Megatron's ``lm loss``. Megatron's T5 samples label padding -1: any id the mask
    drops is read as 0, so the loss kernel never sees an id outside the vocabulary."""
    labels = torch.where(batch["loss_mask"] > 0, batch["labels"], torch.zeros_like(batch["labels"]))
    return language_model_loss(outputs, {"labels": labels, "loss_mask": batch["loss_mask"]}, context)


def num_parameters(config: T5Config, tensor_parallel_size: int = 1) -> int:
    """The whole model's parameters (vocabulary padded for ``tensor_parallel_size``), counted on
    the meta device: nothing is allocated."""
    with torch.device("meta"):
        stage = pipeline_stages(config, 1)[0]
        model = T5Model(config, stage, Kernels(), ParallelConfig(tp=1))
    padding_rows = config.padded_vocab_size(tensor_parallel_size) - config.padded_vocab_size(1)
    copies = 1 if config.untie_embeddings_and_output_weights else 0
    bias = padding_rows if config.output_layer_bias else 0
    return sum(p.numel() for p in model.parameters()) + padding_rows * config.hidden_size * (1 + copies) + bias


def num_floating_point_operations(config: T5Config, batch_size: int) -> float:
    """Forward and backward (3x the forward's matrix products) of one iteration: every linear
    layer of both stacks, the attention scores and sums, and the output layer."""
    h, f, q = config.hidden_size, config.ffn_hidden_size, config.query_projection_size
    enc, dec, vocab = config.seq_length, config.decoder_seq_length, config.padded_vocab_size()
    mlp = h * f * (3 if config.gated else 2)
    encoder_layer = enc * (4 * h * q + mlp) + 2 * enc * enc * q
    decoder_layer = dec * (4 * h * q + 2 * h * q + mlp) + 2 * dec * dec * q + 2 * dec * enc * q + 2 * enc * h * q
    forward = config.num_layers * encoder_layer + config.decoder_num_layers * decoder_layer + dec * h * vocab
    return 3.0 * 2.0 * batch_size * forward


FAMILY = ModelFamily(
    name="t5",
    config_class=T5Config,
    presets=PRESETS,
    build=build_t5,
    init_parameter=init_parameter,
    loss=t5_loss,
    num_parameters=num_parameters,
    num_floating_point_operations=num_floating_point_operations,
    tensor_parallel_plan=tensor_parallel_plan,
    setup_passes=T5_PASSES,
    pipeline_stages=pipeline_stages,
    boundary=boundary,
    batch_keys=BATCH_KEYS,
    datasets=("t5", "t5-mock"),
    description="T5 encoder-decoder: relative-position buckets, RMS norms, ReLU (v1.0), gated-GELU (v1.1) or GELU (Megatron-LM's)",
    hf_mapping=T5_MAPPING,
)
