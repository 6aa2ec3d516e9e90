"""The ``deepseek-v3`` stage module: the MoE decoder (:class:`~mega.models.mixtral.model.MoELanguageModel`)
with multi-token prediction on the last stage (:mod:`mega.models.deepseek_v3.mtp`), and its loss.

In a pipeline the last stage reads the tokens too (the MTP modules embed them shifted), and
when it is not the first it holds a copy of the word embedding tied across the stages (its
gradient summed with the first stage's, as a tied output layer's). The last stage returns
``mtp_logits`` [mtp layers, s, b, vocab] beside ``logits``, and the MTP layers' MoE statistics
after the decoder's rows of ``moe_stats``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from mega.core.kernels import CAUSAL, Kernels
from mega.core.model_family import LossContext, ParallelContext, Stage, stack_stages
from mega.core.parallel import ParallelConfig
from mega.core.pipeline.tied import tie_across_stages
from mega.models.blocks.embedding import Embedding
from mega.models.blocks.language_model import per_token_cross_entropy
from mega.models.deepseek_v3.config import DeepSeekV3Config
from mega.models.deepseek_v3.mtp import MultiTokenPrediction, mtp_losses, shift_left
from mega.models.mixtral.model import MOE_STATS, MoELanguageModel, moe_loss
from mega.models.moe.layer import MoELayer


class DeepSeekModel(MoELanguageModel):
    def __init__(self, config: DeepSeekV3Config, stage: Stage, kernels: Kernels, parallel: ParallelConfig,
                 context: ParallelContext | None = None):
        super().__init__(config, stage, kernels, parallel, context)
        self.mtp = self.build_mtp(config, kernels, context) if config.mtp_num_layers and stage.is_last else None
        if config.mtp_num_layers and not (stage.is_first and stage.is_last) and not self.tied:
            if stage.is_last:  # the MTP modules embed tokens: a copy of the first stage's word embedding
                self.embedding = Embedding(config, config.padded_vocab_size(parallel.tp), words_only=True)
            if self.embedding is not None:
                tie_across_stages(self.embedding.word_embeddings.weight)

    def build_mtp(self, config, kernels: Kernels, context: ParallelContext | None) -> MultiTokenPrediction:
        """The last stage's multi-token prediction modules (a family with its own layers builds them here)."""
        return MultiTokenPrediction(config, kernels, context)

    def forward(self, inputs, position_ids=None, inference_cache=None, logits_to_keep=None, mask=CAUSAL):
        if self.mtp is None or not isinstance(inputs, Mapping):
            return super().forward(inputs, position_ids, inference_cache, logits_to_keep, mask)
        if inputs.get("document_ids") is not None:
            raise ValueError("multi-token prediction over packed sequences (document_ids) is not supported: "
                             "its modules would attend across documents; train without --mtp-num-layers")
        positions = inputs.get("position_ids")
        hidden = self._final_hidden(inputs["tokens"] if self.pre_process else inputs["hidden"], positions)
        outputs = {"logits": self.output_layer(hidden),
                   "mtp_logits": self.mtp(hidden, inputs["tokens"], positions, self.embedding, self.output_layer)}
        stats = self._layer_stats(torch.float32)
        if MOE_STATS in inputs:
            stats = inputs[MOE_STATS] + stats
        mtp_stats = [layer.transformer_layer.mlp.stats for layer in self.mtp.layers
                     if isinstance(layer.transformer_layer.mlp, MoELayer)]
        outputs[MOE_STATS] = torch.cat([stats, torch.stack(mtp_stats).to(stats.dtype)]) if mtp_stats else stats
        return outputs


def build_deepseek_model(config: DeepSeekV3Config, stage: Stage, *, kernels: Kernels,
                         parallel: ParallelConfig, context: ParallelContext | None = None) -> DeepSeekModel:
    config.validate_parallel(parallel)
    if config.mtp_num_layers and parallel.cp > 1:
        raise ValueError("--mtp-num-layers with --context-parallel-size > 1: the MTP modules shift tokens across the "
                         "context-parallel split, which mega does not do yet")
    return DeepSeekModel(config, stage, kernels, parallel, context)


def deepseek_stages(config: DeepSeekV3Config, pp: int, vpp: int = 1) -> list[Stage]:
    """The decoder split as every family's; with MTP the last stage reads the tokens too."""
    stages = stack_stages(config, pp, vpp)
    if config.mtp_num_layers and "tokens" not in stages[-1].batch_keys:
        stages[-1] = dataclasses.replace(stages[-1], batch_keys=(*stages[-1].batch_keys, "tokens", "position_ids"))
    return stages


def deepseek_loss(outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor],
                  context: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`~mega.models.mixtral.model.moe_loss` plus ``--mtp-loss-scaling-factor`` times the mean of
    the MTP modules' losses, each logged as ``mtp_N loss``."""
    loss, metrics = moe_loss(outputs, batch, context)
    if "mtp_logits" not in outputs:
        return loss, metrics
    labels, per_token = batch["labels"], []
    for logits in outputs["mtp_logits"]:
        labels = shift_left(labels)
        per_token.append(per_token_cross_entropy(context.kernels, logits, labels, context.tp_group,
                                                 context.config.vocab_size))
    means = mtp_losses(per_token, batch["loss_mask"])
    scale = context.config.mtp_loss_scaling_factor / len(means)
    for number, mean in enumerate(means, start=1):
        metrics[f"mtp_{number} loss"] = mean.detach()
    return loss + scale * sum(means), metrics


