"""Multi-token prediction (DeepSeek-V3; megatron-core's ``MultiTokenPredictionBlock``), on the
last pipeline stage. Module k (0-based) predicts the token k + 2 positions ahead:

    ids_k     = ids shifted left k + 1 times (the vacated last positions hold token 0)
    h_k       = final_layernorm(transformer_layer(eh_proj([enorm(embed(ids_k)); hnorm(h_{k-1})])))
    logits_k  = output_layer(h_k)      (h_{-1}: the decoder's output after its final norm)

and its loss is the cross-entropy against the labels shifted left k + 1 times, over the loss
mask shifted the same way (the last k + 1 positions leave it): megatron-core's ``roll_tensor``.
The model's loss adds ``--mtp-loss-scaling-factor`` times the mean of the modules' losses,
each logged as ``mtp_{k+1} loss``. Names: ``mtp.layers.k.{enorm,hnorm,eh_proj,final_layernorm}``
and ``mtp.layers.k.transformer_layer.*`` (a layer like the decoder's last). The embedding and
the output layer are the model's (a last stage that is not the first holds a copy of the word
embedding tied across the pipeline, as a tied output layer's).

``eh_proj`` is whole on every tensor rank (megatron-core splits it by columns and gathers the
output: the same numbers); under sequence parallelism it runs on this rank's slice.
"""

from __future__ import annotations

import torch
from torch import nn

from mega.core.kernels import Kernels
from mega.core.model_family import ParallelContext
from mega.models.blocks.block import TransformerLayer
from mega.models.blocks.norms import build_norm


def shift_left(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` [b, s] one position left along the sequence, the last position zero (megatron-core's
    ``roll_tensor(shifts=-1)``)."""
    return torch.cat((tensor[:, 1:], torch.zeros_like(tensor[:, :1])), dim=1)


class MTPLayer(nn.Module):
    """``norm()`` and ``layer()``: a family's own norms and transformer layer (default: the
    config's norm, and a layer like the decoder's last)."""

    def __init__(self, config, kernels: Kernels, context: ParallelContext | None = None, norm=None, layer=None):
        super().__init__()
        norm = norm or (lambda: build_norm(config, kernels))
        self.enorm = norm()
        self.hnorm = norm()
        self.eh_proj = kernels.linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.transformer_layer = (layer() if layer is not None
                                  else TransformerLayer(config, kernels, config.num_layers - 1, context))
        self.final_layernorm = norm()

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, position_ids: torch.Tensor | None,
                inference_cache=None) -> torch.Tensor:
        """``inference_cache``: this layer's attention cache when drafting tokens for speculative
        decoding (``mega.inference``'s MTP proposer, :mod:`mega.models.blocks.kv_cache`)."""
        joined = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        return self.final_layernorm(self.transformer_layer(joined, position_ids, inference_cache))


class MultiTokenPrediction(nn.Module):
    def __init__(self, config, kernels: Kernels, context: ParallelContext | None = None, norm=None, layer=None):
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(config, kernels, context, norm, layer)
                                    for _ in range(config.mtp_num_layers))

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor | None,
                embedding: nn.Module, output_layer: nn.Module) -> torch.Tensor:
        """Logits ``[mtp layers, s, b, vocab (shard)]`` of the decoder output ``hidden``."""
        logits = []
        for layer in self.layers:
            tokens = shift_left(tokens)
            hidden = layer(hidden, embedding(tokens, position_ids), position_ids)
            logits.append(output_layer(hidden))
        return torch.stack(logits)


def mtp_losses(per_token_losses: list[torch.Tensor], loss_mask: torch.Tensor) -> list[torch.Tensor]:
    """Each module's mean loss: ``per_token_losses[k]`` [b, s] (against labels shifted k + 1
    times) over the loss mask shifted as often."""
    means = []
    for per_token in per_token_losses:
        loss_mask = shift_left(loss_mask)
        means.append((per_token * loss_mask).sum() / loss_mask.sum().clamp(min=1))
    return means
