"""The pre-norm transformer layer and the stack of layers one pipeline stage holds."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mega.core.kernels import Kernels
from mega.models.attention import SelfAttention
from mega.models.config import TransformerConfig
from mega.models.fusions import bias_dropout_add
from mega.models.kv_cache import KVCache, LayerKVCache
from mega.models.mlp import MLP, fused_norm_mlp
from mega.models.norms import build_norm, fused_norm_aliases
from mega.models.recompute import is_recomputing_allowed, recomputed


class TransformerLayer(nn.Module):
    """x + dropout(attention(norm(x))), then x + dropout(mlp(norm(x))).

    With a ``norm_linear`` kernel the norms live inside QKV and fc1 (no ``input_layernorm`` /
    ``pre_mlp_layernorm`` modules), with a ``norm_mlp`` kernel the second norm lives inside the
    one-module MLP; ``parameter_aliases`` maps their weights to the canonical names, so
    checkpoints do not depend on the kernels.
    """

    def __init__(self, config: TransformerConfig, kernels: Kernels):
        super().__init__()
        fused = kernels.get("norm_linear") is not None
        fused_mlp = None if getattr(config, "num_experts", None) else fused_norm_mlp(config, kernels)
        self.input_layernorm = None if fused else build_norm(config, kernels)
        self.self_attention = SelfAttention(config, kernels)
        self.pre_mlp_layernorm = None if fused or fused_mlp is not None else build_norm(config, kernels)
        self.mlp = fused_mlp if fused_mlp is not None else build_mlp(config, kernels)
        self.fused_mlp = fused_mlp is not None  # the plan then splits the MLP module whole
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        self.bias_dropout_fusion = getattr(config, "bias_dropout_fusion", False)
        if fused or fused_mlp is not None:
            self.parameter_aliases = fused_norm_aliases(config, norm_linear=fused, norm_mlp=fused_mlp is not None)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                inference_cache: LayerKVCache | None = None) -> torch.Tensor:
        normed = self.input_layernorm(hidden) if self.input_layernorm is not None else hidden
        hidden = self._dropout_add(self.self_attention(normed, position_ids, inference_cache), hidden)
        normed = self.pre_mlp_layernorm(hidden) if self.pre_mlp_layernorm is not None else hidden
        return self._dropout_add(self.mlp(normed), hidden)

    def _dropout_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + dropout(x)``, one kernel with --bias-dropout-fusion (mega.models.fusions)."""
        if self.bias_dropout_fusion:
            return bias_dropout_add(x, None, residual, self.hidden_dropout.p, self.training)
        return residual + self.hidden_dropout(x)


def build_mlp(config: TransformerConfig, kernels: Kernels) -> nn.Module:
    """A dense MLP, or a mixture of experts when the config has experts (the ``mixtral`` family)."""
    if getattr(config, "num_experts", None):
        from mega.models.moe.layer import MoELayer

        return MoELayer(config, kernels)
    return MLP(config, kernels)


class TransformerBlock(nn.Module):
    """The decoder layers numbered ``layer_numbers`` (global numbers, the parameter names'
    ``decoder.layers.N``), and the final norm on the last stage.

    Set from outside by ``parallelize``: ``fork_rng`` (under sequence parallelism every
    activation here is this rank's slice of the sequence, so the whole block draws dropout from
    the tracker's model-parallel stream, Megatron's convention), ``rng_tracker`` and
    ``recompute_runs`` (full recompute: :func:`mega.models.recompute.layer_runs`).
    """

    def __init__(self, config: TransformerConfig, layer_numbers: range, final_norm: bool, kernels: Kernels):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleDict({str(number): TransformerLayer(config, kernels) for number in layer_numbers})
        self.final_layernorm = build_norm(config, kernels) if final_norm else None
        self.rng_tracker = None
        self.fork_rng = False
        self.recompute_runs = [(0, len(self.layers), False)]

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                inference_cache: KVCache | None = None) -> torch.Tensor:
        if inference_cache is not None:  # generating: no recompute, no dropout to fork
            for number, layer in self.layers.items():
                hidden = layer(hidden, position_ids, inference_cache.layer(int(number)))
            return self.final_layernorm(hidden) if self.final_layernorm is not None else hidden
        layers = list(self.layers.values())
        fork = self.rng_tracker.fork() if self.rng_tracker is not None and self.fork_rng else contextlib.nullcontext()
        with fork:
            for start, end, recompute in self.recompute_runs:
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
