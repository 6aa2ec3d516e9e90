"""The two pieces every transformer stack of the package is made of: ``PreNormLayer`` (the
residual layer, pre-norm) and ``LayerStack`` (the layers one pipeline stage holds of a stack,
then its final norm). The decoder-only LMs (``decoder``), BERT (``encoder``) and T5 (``encoder``
and ``decoder``) build their stacks from them.

A ``LayerStack`` is single-device code. It takes the RNG stream it runs in at construction
(``rng_stream``: under sequence parallelism every activation is a rank's slice, so its dropout
draws from the tracker's model-parallel stream). Which runs of layers it recomputes
(``recompute_runs``, replaying ``recompute_rng_tracker``) is set by the recompute setup pass of
:mod:`mega.models.parallelize`: recompute is a phase of the setup of its own (after the adapters
and FP8 layers it recomputes, before compile), which a run may leave out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from torch import nn

from mega.models.blocks.kv_cache import KVCache
from mega.models.blocks.recompute import is_recomputing_allowed, recomputed
from mega.models.config import ModelConfigError


def check_layers(layers: range, num_layers: int, stack: str | None = None) -> None:
    """``layers`` must be consecutive layers of a ``num_layers``-layer model (or of the stack
    named ``stack``)."""
    if layers.step != 1 or layers.start < 0 or layers.stop > num_layers:
        wrong = f"layers {layers} are not consecutive layers of a {num_layers}-layer"
        raise ModelConfigError(f"{wrong} model" if stack is None else f"{stack} {wrong} stack")


class PreNormLayer(nn.Module):
    """x + dropout(attention(norm(x), ...)), then x + dropout(mlp(norm(x))).

    Whatever follows the hidden state in a call (positions, a mask, a layer's cache) goes to the
    attention. A norm may be None where a fused kernel holds it (inside QKV, fc1 or the MLP).
    ``post_attention_layernorm`` / ``post_mlp_layernorm``: norms of each sublayer's output before
    the residual add (``--layernorm-placement post``, OLMo2's), where the pre-norms are None.
    """

    def __init__(self, input_layernorm: nn.Module | None, self_attention: nn.Module,
                 pre_mlp_layernorm: nn.Module | None, mlp: nn.Module, hidden_dropout: float,
                 post_attention_layernorm: nn.Module | None = None, post_mlp_layernorm: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attention = self_attention
        self.pre_mlp_layernorm = pre_mlp_layernorm
        self.mlp = mlp
        self.hidden_dropout = nn.Dropout(hidden_dropout)
        if post_attention_layernorm is not None:  # registered only where used: names stay the pre-norm layer's
            self.post_attention_layernorm = post_attention_layernorm
            self.post_mlp_layernorm = post_mlp_layernorm

    def forward(self, hidden: torch.Tensor, *attention_args, **attention_kwargs) -> torch.Tensor:
        normed = self.input_layernorm(hidden) if self.input_layernorm is not None else hidden
        attended = self.self_attention(normed, *attention_args, **attention_kwargs)
        if hasattr(self, "post_attention_layernorm"):
            attended = self.post_attention_layernorm(attended)
        hidden = self.dropout_add(attended, hidden)
        normed = self.pre_mlp_layernorm(hidden) if self.pre_mlp_layernorm is not None else hidden
        mlp_out = self.mlp(normed)
        if hasattr(self, "post_mlp_layernorm"):
            mlp_out = self.post_mlp_layernorm(mlp_out)
        return self.dropout_add(mlp_out, hidden)

    def dropout_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + dropout(x)`` (a layer may fuse it)."""
        return residual + self.hidden_dropout(x)


class LayerStack(nn.Module):
    """``layers``: this stage's layers of the stack by global number (the parameter names'
    ``<stack>.layers.N``); ``final_layernorm``: the stack's last norm, on the stage holding its
    last layer (None elsewhere, or for a stack of post-norm layers); ``final_dropout``: dropout
    after that norm (T5's).

    Calling the stack runs every layer with the hidden state and the further arguments given,
    then the final norm. ``rng_stream``: a tracker whose model-parallel stream the layers draw
    their dropout from (sequence parallelism: every activation is this rank's slice); None: the
    default stream. Set by the recompute pass (:mod:`mega.models.parallelize`):

    * ``recompute_runs``: the layers as consecutive runs ``(start, end, recompute)``
      (:func:`mega.models.blocks.recompute.layer_runs`), and ``recompute_rng_tracker``, whose streams a
      recomputed run replays.
    """

    def __init__(self, layers: Mapping[int, nn.Module], final_layernorm: nn.Module | None = None,
                 final_dropout: float | None = None, rng_stream=None):
        super().__init__()
        self.layers = nn.ModuleDict({str(number): layer for number, layer in layers.items()})
        self.final_layernorm = final_layernorm
        self.final_dropout = nn.Dropout(final_dropout) if final_dropout is not None else None
        self.rng_stream = rng_stream
        self.recompute_runs = [(0, len(self.layers), False)]
        self.recompute_rng_tracker = None

    def forward(self, hidden: torch.Tensor, *args, cache: KVCache | None = None, **kwargs) -> torch.Tensor:
        """``cache`` (generation): each layer is handed its own cache after ``args``, and nothing
        is recomputed or forked."""
        return self.finish(self.run_layers(hidden, *args, cache=cache, **kwargs))

    def run_layers(self, hidden: torch.Tensor, *args, cache: KVCache | None = None, **kwargs) -> torch.Tensor:
        if cache is not None:
            for number, layer in self.layers.items():
                hidden = layer(hidden, *args, cache.layer(int(number)), **kwargs)
            return hidden
        layers = list(self.layers.values())
        stream = self.rng_stream.fork() if self.rng_stream is not None else contextlib.nullcontext()
        with stream:
            for start, end, recompute in self.recompute_runs:
                run = _LayerRun(layers[start:end])
                if recompute and is_recomputing_allowed(self):
                    hidden = recomputed(run, hidden, *args, rng_tracker=self.recompute_rng_tracker, **kwargs)
                else:
                    hidden = run(hidden, *args, **kwargs)
        return hidden

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm (and dropout) when this stage holds the stack's last layer."""
        if self.final_layernorm is None:
            return hidden
        hidden = self.final_layernorm(hidden)
        return self.final_dropout(hidden) if self.final_dropout is not None else hidden


class _LayerRun:
    """Consecutive layers as one callable: the unit full recompute checkpoints."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = layers

    def __call__(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden, *args, **kwargs)
        return hidden
