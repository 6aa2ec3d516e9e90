"""The ``bert`` family: BERT encoders trained with masked-LM and sentence-order losses, as
Megatron's ``pretrain_bert.py`` trains them, computing what Hugging Face's ``BertForPreTraining``
computes.

Presets: ``base`` and ``large`` are the shapes of Devlin et al. (2018) with the uncased
WordPiece vocabulary (30522 tokens); ``minilm-l6`` is all-MiniLM-L6-v2's (Wang et al. 2020: 6
layers of 384, 12 heads); ``tiny`` is for tests. The training command replaces ``vocab_size``
with its tokenizer's.

Micro-batches carry Megatron's BERT sample fields (``text``, ``types``, ``padding_mask``,
``labels``, ``loss_mask``, ``is_random``), made by the ``bert`` / ``bert-mock`` dataset builders.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from mega.core.kernels import Kernels
from mega.core.model_family import LossContext, ModelFamily, ParallelContext, Stage, stack_stages
from mega.core.parallel import ParallelConfig
from mega.core.parallel.plan import Colwise, PlanStyle, Rowwise, SequenceParallelOutput, VocabEmbedding
from mega.models.bert.config import BertConfig
from mega.models.bert.hf_bert import BERT
from mega.models.bert.model import BertModel
from mega.models.blocks.language_model import per_token_cross_entropy
from mega.models.flops import num_floating_point_operations
from mega.models.initialization import init_parameter
from mega.models.parallelize import transformer_passes

FIRST_STAGE_KEYS = ("text", "types", "padding_mask")
# Every stage attends with the padding mask, so every stage reads it.
LATER_STAGE_KEYS = ("padding_mask",)
BATCH_KEYS = ("text", "types", "padding_mask", "labels", "loss_mask", "is_random")


def bert_config(num_layers: int, hidden_size: int, num_attention_heads: int, **overrides) -> BertConfig:
    settings = dict(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        seq_length=512, max_position_embeddings=512, vocab_size=30522,
        position_embedding_type="learned_absolute", normalization="LayerNorm", layernorm_epsilon=1e-12,
        hidden_dropout=0.1, attention_dropout=0.1, init_method_std=0.02,
    )
    settings.update(overrides)
    return BertConfig(**settings)


PRESETS = {
    "tiny": bert_config(2, 64, 4, seq_length=128, max_position_embeddings=128),
    "base": bert_config(12, 768, 12),
    "large": bert_config(24, 1024, 16),
    "minilm-l6": bert_config(6, 384, 12),
}


def build_bert(config: BertConfig, stage: Stage, *, kernels: Kernels, parallel: ParallelConfig,
               context: ParallelContext | None = None) -> BertModel:
    return BertModel(config, stage, kernels, parallel, context)


def bert_stages(config: BertConfig, pp: int, vpp: int = 1, layers_per_stage=None) -> list[Stage]:
    stages = stack_stages(config, pp, vpp, stack="encoder", batch_keys=FIRST_STAGE_KEYS,
                          layers_per_stage=layers_per_stage)
    return [stage if stage.is_first else Stage(stage.index, stage.num_stages, stage.layers, LATER_STAGE_KEYS)
            for stage in stages]


def tensor_parallel_plan(config: BertConfig, stage: Stage) -> dict[str, PlanStyle]:
    """Megatron's split of BERT: the layers' as GPT's; the vocabulary in the word embedding and
    the MLM decoder (its bias too); the small dense layers of the heads whole on every rank."""
    pre_process, post_process = stage.is_first, stage.is_last
    plan: dict[str, PlanStyle] = {}
    if pre_process or (post_process and not config.untie_embeddings_and_output_weights):
        plan["embedding"] = SequenceParallelOutput()
        plan["embedding.word_embeddings"] = VocabEmbedding()
    plan["encoder.layers.*.self_attention.linear_qkv"] = Colwise()
    plan["encoder.layers.*.self_attention.linear_proj"] = Rowwise()
    plan["encoder.layers.*.mlp.linear_fc1"] = Colwise()
    plan["encoder.layers.*.mlp.linear_fc2"] = Rowwise()
    if post_process:
        plan["output_layer"] = Colwise()
    return plan


# The dense transformer's passes with BERT's plan, amended by keep_heads_whole.
BERT_PASSES = transformer_passes(lambda model, setup: tensor_parallel_plan(setup.config, model.stage),
                                 [lambda model, setup: keep_heads_whole(model)])


def keep_heads_whole(model: BertModel) -> None:
    """A pass after tensor parallelism: the pooler and the binary head see the whole (gathered)
    sequence, so their gradients are already whole on every tensor-parallel rank and are not
    summed over it as sequence-parallel parameters are."""
    if not (model.post_process and model.config.bert_binary_head):
        return
    for parameter in (*model.pooler.parameters(), *model.binary_head.parameters()):
        parameter.sequence_parallel = False


def bert_loss(outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor],
              context: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's BERT loss: the masked-LM cross-entropy averaged over the masked positions
    (``lm loss``) plus, with the binary head, the sentence-order cross-entropy (``sop loss``)."""
    loss_mask = batch["loss_mask"].float()
    # Unmasked positions carry the label -1; any valid id serves there, the mask drops them.
    labels = batch["labels"].clamp_min(0)
    per_token = per_token_cross_entropy(context.kernels, outputs["logits"], labels, context.tp_group,
                                        context.config.vocab_size)
    lm_loss = (per_token * loss_mask).sum() / loss_mask.sum().clamp_min(1.0)
    metrics = {"lm loss": lm_loss.detach()}
    if "binary_logits" not in outputs:
        return lm_loss, metrics
    sop_loss = F.cross_entropy(outputs["binary_logits"].float(), batch["is_random"].reshape(-1))
    metrics["sop loss"] = sop_loss.detach()
    return lm_loss + sop_loss, metrics


def bert_num_parameters(config: BertConfig, tensor_parallel_size: int = 1) -> int:
    """Every parameter of the model (the tied decoder weight once), vocabulary padded for tp."""
    h, ffn = config.hidden_size, config.ffn_hidden_size
    vocab = config.padded_vocab_size(tensor_parallel_size)
    norm = 2 * h
    layer = (3 * h * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h) + 2 * norm
    embeddings = (vocab + config.max_position_embeddings + config.num_tokentypes) * h + norm
    lm_head = h * h + h + norm + vocab + (vocab * h if config.untie_embeddings_and_output_weights else 0)
    binary = (h * h + h) + (2 * h + 2) if config.bert_binary_head else 0
    return embeddings + config.num_layers * layer + lm_head + binary


def bert_floating_point_operations(config: BertConfig, batch_size: int) -> float:
    """One iteration's FLOPs, forward and backward: the encoder attends in both directions (the
    whole score matrix counts, no causal halving), plus the MLM transform and the pooler."""
    tokens = batch_size * config.seq_length
    h = config.hidden_size
    layers_and_logits = num_floating_point_operations(config, batch_size, causal=False)
    transform = 3 * 2 * tokens * h * h
    pooler = 3 * 2 * batch_size * (h * h + 2 * h) if config.bert_binary_head else 0
    return float(layers_and_logits + transform + pooler)


FAMILY = ModelFamily(
    name="bert",
    config_class=BertConfig,
    presets=PRESETS,
    build=build_bert,
    init_parameter=init_parameter,
    loss=bert_loss,
    num_parameters=bert_num_parameters,
    num_floating_point_operations=bert_floating_point_operations,
    tensor_parallel_plan=tensor_parallel_plan,
    setup_passes=BERT_PASSES,
    pipeline_stages=bert_stages,
    batch_keys=BATCH_KEYS,
    datasets=("bert", "bert-mock"),
    features=frozenset({"embeddings"}),  # mega serve / mega embed pool its hidden states
    description="BERT: bidirectional post-LN encoder, masked-LM and sentence-order heads",
    hf_mapping=BERT,
)
