"""The pre-norm transformer layer and the stack of layers one pipeline stage holds."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mega.models.attention import SelfAttention
from mega.models.config import TransformerConfig
from mega.models.kv_cache import KVCache, LayerKVCache
from mega.models.mlp import MLP
from mega.models.norms import build_norm
from mega.models.recompute import is_recomputing_allowed, layer_runs, recomputed


class TransformerLayer(nn.Module):
    """x + dropout(attention(norm(x))), then x + dropout(mlp(norm(x)))."""

    def __init__(self, config: TransformerConfig, backend, rng_tracker=None, sequence_parallel: bool = False):
        super().__init__()
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config, backend, rng_tracker, sequence_parallel)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = MLP(config)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                inference_cache: LayerKVCache | None = None) -> torch.Tensor:
        attention = self.self_attention(self.input_layernorm(hidden), position_ids, inference_cache)
        hidden = hidden + self.hidden_dropout(attention)
        return hidden + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(hidden)))


class TransformerBlock(nn.Module):
    """The decoder layers numbered ``layer_numbers`` (global numbers, the parameter names'
    ``decoder.layers.N``), and the final norm on the last stage.

    Under sequence parallelism every activation here is this rank's slice of the sequence, so
    dropout draws from the tracker's model-parallel stream (Megatron's convention).
    """

    def __init__(self, config: TransformerConfig, layer_numbers: range, final_norm: bool, backend,
                 rng_tracker=None, sequence_parallel: bool = False):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleDict({
            str(number): TransformerLayer(config, backend, rng_tracker, sequence_parallel)
            for number in layer_numbers
        })
        self.final_layernorm = build_norm(config) if final_norm else None
        self.rng_tracker = rng_tracker
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                inference_cache: KVCache | None = None) -> torch.Tensor:
        if inference_cache is not None:  # generating: no recompute, no dropout to fork
            for number, layer in self.layers.items():
                hidden = layer(hidden, position_ids, inference_cache.layer(int(number)))
            return self.final_layernorm(hidden) if self.final_layernorm is not None else hidden
        layers = list(self.layers.values())
        fork = self.rng_tracker.fork() if self.rng_tracker is not None and self.sequence_parallel else contextlib.nullcontext()
        with fork:
            for start, end, recompute in layer_runs(self.config, len(layers)):
                run = _LayerRun(layers[start:end])
                if recompute and is_recomputing_allowed(self):
                    hidden = recomputed(run, hidden, position_ids, rng_tracker=self.rng_tracker)
                else:
                    hidden = run(hidden, position_ids)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden


class _LayerRun:
    """Consecutive layers as one callable: the unit full recompute checkpoints."""

    def __init__(self, layers: list[TransformerLayer]):
        self.layers = layers

    def __call__(self, hidden: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden, position_ids)
        return hidden
