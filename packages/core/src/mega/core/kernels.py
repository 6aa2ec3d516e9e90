"""Kernel backends: typed component factories that models ask for by kind.

Models never import a kernel library. They ask a :class:`Kernels` object for a component of a
kind (``kernels.norm("RMSNorm", hidden, eps)``, ``kernels.attention(q, k, v, mask=...)``), and
the user picks which registered backend fills each kind: ``--kernels NAME`` takes every kind
that backend fills, ``--attention-backend``, ``--normalization-backend``, ... override one kind.
mega-models registers ``torch`` (torch-native components, every kind but the optional fused ones,
``norm_linear``, ``norm_mlp`` and ``linear_loss``); a plugin registers its own backend through
``register_kernel_backends``.

The kinds and what their component is:

* ``attention``: ``fn(query, key, value, *, mask: AttentionMask, dropout_p, softmax_scale)``
  over ``[batch, heads, seq, head_dim]``; ``key``/``value`` may have fewer heads (query head
  ``i`` uses key head ``i // (heads // kv_heads)``). Dropout draws from torch's default RNG of
  the tensors' device (the caller forks it).
* ``norm``: ``factory(kind, hidden_size, eps) -> nn.Module`` for ``kind`` ``"LayerNorm"`` (with
  bias) or ``"RMSNorm"``; parameters ``weight`` (and ``bias``).
* ``linear``: ``factory(in_features, out_features, bias) -> nn.Module`` with ``weight``
  ``[out, in]`` (and ``bias``).
* ``norm_linear``: ``factory(norm_kind, in_features, out_features, bias, eps) -> nn.Module``: a
  norm fused into the following linear layer (Transformer Engine's LayerNormLinear), holding
  ``layer_norm_weight`` (and ``layer_norm_bias``), ``weight`` and ``bias``; the module that
  uses it declares where the norm's weights live canonically (see
  :func:`mega.core.parameter_names.canonical_names`).
* ``norm_mlp``: the whole MLP block with the norm before it in one module (Transformer Engine's
  LayerNormMLP). A factory ``(norm_kind, hidden_size, ffn_hidden_size, activation, bias, eps)
  -> nn.Module`` computing ``fc2(act(fc1(norm(x))))``, with an ``activations`` attribute: the
  activation names (as for ``activation``) it computes exactly as the torch backend does; for
  any other the model composes the unfused components. The module holds ``layer_norm_weight``
  (and ``layer_norm_bias``), ``fc1_weight`` (``[gate; up]`` for the gated activations),
  ``fc2_weight`` (and ``fc1_bias``, ``fc2_bias``); the layer using it declares their canonical
  names. Under tensor parallelism it is split whole (:class:`~mega.core.parallel.plan.ColumnThenRow`).
* ``activation``: ``factory(name) -> fn(x)`` for ``"gelu"``, ``"gelu_tanh"``, ``"swiglu"``
  (``x`` is ``[gate; up]`` stacked on the last dimension), ``"relu"``, ``"geglu"``.
* ``rotary``: ``fn(x, cos, sin)`` rotating ``x`` ``[seq, batch, ..., head_dim]`` (rotate-half) by
  ``cos``/``sin`` ``[seq, batch or 1, 1..., head_dim / 2]`` of as many dimensions (a grouped query
  arrives as a strided view ``[seq, batch, groups, queries per group, head_dim]``); returns a new
  tensor of ``x``'s shape, ``x`` untouched. Models hand ``cos``/``sin`` in ``x``'s dtype.
* ``loss``: ``fn(logits, labels, tp_group, vocab_size) -> [same shape as labels]`` per-token
  cross-entropy of logits ``[..., vocab (shard over tp_group)]`` over the first ``vocab_size``
  rows: the padded rows take no part (None: every row is real).
* ``linear_loss``: ``fn(hidden, weight, labels, loss_mask, tp_group, vocab_size) -> scalar``: the
  output layer and the cross-entropy in one, never holding the logits of every token: the fp32
  sum over tokens of ``loss_mask * cross-entropy(hidden @ weight[:vocab_size].T, labels)``, with
  ``hidden`` ``[tokens, hidden_size]``, ``weight`` the output layer's ``[vocab (padded), hidden]``,
  ``labels`` and ``loss_mask`` ``[tokens]``. Optional: with ``torch`` selected the model computes
  logits and uses ``loss``. A component whose ``vocab_parallel`` attribute is not True serves only
  a vocabulary held whole (``tp_group`` None or of size 1); :func:`check_linear_loss` refuses it
  otherwise (the run's checks, before any work, and models when built).
* ``block_attention``: attention over one block of keys at a time, for attention split across
  ranks (context parallelism: ring attention merges the blocks by the online-softmax rule). An
  object with ``forward(query, key, value, *, causal, softmax_scale) -> (out, lse)`` and
  ``backward(grad_out, query, key, value, out, lse, *, causal, softmax_scale) -> (grad_query,
  grad_key, grad_value)``, shapes as for ``attention`` (``key``/``value`` may have fewer heads;
  their gradients have as many as they do). ``lse`` is the fp32 ``[batch, heads, queries]``
  (or wider) log-sum-exp of the scaled scores; ``causal`` aligns at the end as ``AttentionMask.causal``.
  ``backward`` is given the *final* ``out`` and ``lse`` of each query (merged over every key
  block) and returns this block's share of the gradients, as flash-attention's backward does.
  A component whose ``takes_mask`` attribute is True also takes ``mask``, a bool ``[batch, 1,
  queries, keys]`` (True: the query sees the key) applied with ``causal``: rows of several
  documents under context parallelism (:mod:`mega.core.parallel.document_chunks`) need it.

A backend may also have ``features`` (a set of capabilities such as ``"fp8"`` or
``"tp_comm_overlap"``) that flags like ``--fp8-hybrid`` ask for. Modules a backend builds may
keep state beyond their parameters in ``get_extra_state()`` (a tensor): checkpoints save it per
tensor-parallel rank and restore it where the same backend and layout load them.

A module a backend builds that does its own tensor/sequence-parallel communication implements
``to_tensor_parallel(style, group, sequence_parallel) -> nn.Module``; a tensor-parallel plan
then hands that layer to it instead of swapping it for the core's parallel layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mega.core.plugins import Plugins, get_plugins

if TYPE_CHECKING:
    import torch

KINDS = ("attention", "norm", "linear", "norm_linear", "norm_mlp", "activation", "rotary", "loss",
         "block_attention", "linear_loss")
DEFAULT_BACKEND = "torch"
# Fusions the torch backend does not fill: selecting ``torch`` for them means "not fused", and
# ``Kernels.get`` returns None so the model composes the unfused components instead.
OPTIONAL_KINDS = frozenset({"norm_linear", "norm_mlp", "linear_loss"})


class KernelBackendError(RuntimeError):
    """A backend that is not registered, fills no such kind, or is not usable on this machine."""


@dataclass(frozen=True)
class AttentionMask:
    """Which keys each query may attend to.

    * ``causal``: query ``i`` sees keys ``<= i + (keys - queries)`` (aligned at the end, so a
      query continuing a cached prefix sees the whole prefix).
    * ``padding``: ``[batch, keys]`` bool, True where the key is a real token.
    * ``cu_seqlens``: packed sequences, ``[n + 1]`` int32 offsets of ``n`` sequences laid end to
      end, the batch's rows one after the other (flash-attention's varlen layout; no sequence
      crosses a row); no token sees another sequence's.
    * ``bias``: an additive ``[batch or 1, heads, queries, keys]`` float (relative positions).
    """

    causal: bool = False
    padding: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    bias: torch.Tensor | None = None


CAUSAL = AttentionMask(causal=True)
FULL = AttentionMask()


@runtime_checkable
class KernelBackend(Protocol):
    name: str
    kinds: frozenset[str]

    def is_available(self) -> tuple[bool, str]:
        """(True, "") or (False, what is missing: the package and version, a GPU, its compute capability)."""

    def component(self, kind: str) -> Any:
        """The component of ``kind`` (one of ``kinds``)."""


def get_kernel_backend(name: str, kind: str | None = None, plugins: Plugins | None = None) -> KernelBackend:
    """The registered backend ``name``, checked to fill ``kind`` and to be usable here."""
    if plugins is None:
        plugins = get_plugins()
    backend = plugins.kernel_backends.get(name)  # an unknown name lists the installed ones
    kinds = frozenset(getattr(backend, "kinds", ()))
    if kind is not None and kind not in kinds:
        raise KernelBackendError(
            f"kernel backend {name!r} fills {', '.join(sorted(kinds)) or 'no kind'}, not {kind!r}"
        )
    available, missing = backend.is_available()
    if not available:
        raise KernelBackendError(f"kernel backend {name!r} is not available: {missing}")
    return backend


def select_backends(preset: str | None = None, overrides: Mapping[str, str | None] | None = None,
                    plugins: Plugins | None = None) -> dict[str, str]:
    """Kind -> backend name: ``overrides`` first, then the ``preset`` backend for every kind it
    fills, then ``torch``. Every chosen backend is checked to be usable (fails before any work)."""
    chosen = {kind: DEFAULT_BACKEND for kind in KINDS}
    if preset is not None:
        backend = get_kernel_backend(preset, plugins=plugins)
        chosen.update({kind: preset for kind in backend.kinds if kind in chosen})
    for kind, name in (overrides or {}).items():
        if kind not in chosen:
            raise KernelBackendError(f"no kernel kind {kind!r}; kinds: {', '.join(KINDS)}")
        if name is not None:
            chosen[kind] = name
    for kind, name in chosen.items():
        if kind not in OPTIONAL_KINDS or name != DEFAULT_BACKEND:  # torch fuses none of them
            get_kernel_backend(name, kind, plugins)
    return chosen


def check_linear_loss(kernels: Kernels, tp: int) -> None:
    """Refuse a ``linear_loss`` component that needs the whole vocabulary when ``tp`` ranks
    split it (the run's checks call this before any work, and models when they are built)."""
    component = kernels.get("linear_loss")
    if component is not None and tp > 1 and not getattr(component, "vocab_parallel", False):
        name = kernels.selection["linear_loss"]
        raise KernelBackendError(
            f"--linear-loss-backend {name} (the output layer fused into the cross-entropy) needs the whole "
            f"vocabulary on one rank, but --tensor-model-parallel-size is {tp}; add --linear-loss-backend torch")


class Kernels:
    """The components of the selected backends, by kind. ``Kernels()`` is torch-native."""

    def __init__(self, selection: Mapping[str, str] | None = None, plugins: Plugins | None = None):
        self.selection = {kind: DEFAULT_BACKEND for kind in KINDS} | dict(selection or {})
        self._plugins = plugins
        self._cache: dict[str, Any] = {}

    def get(self, kind: str) -> Any:
        """The component of ``kind``; None for an optional fusion (``norm_linear``, ``norm_mlp``,
        ``linear_loss``) that no backend was selected for."""
        if kind not in self._cache:
            name = self.selection[kind]
            if kind in OPTIONAL_KINDS and name == DEFAULT_BACKEND:
                self._cache[kind] = None
            else:
                self._cache[kind] = get_kernel_backend(name, kind, self._plugins).component(kind)
        return self._cache[kind]

    def attention(self, query, key, value, *, mask: AttentionMask, dropout_p: float = 0.0,
                  softmax_scale: float | None = None):
        return self.get("attention")(query, key, value, mask=mask, dropout_p=dropout_p, softmax_scale=softmax_scale)

    def norm(self, kind: str, hidden_size: int, eps: float):
        return self.get("norm")(kind, hidden_size, eps)

    def linear(self, in_features: int, out_features: int, bias: bool = True):
        return self.get("linear")(in_features, out_features, bias)

    def activation(self, name: str):
        return self.get("activation")(name)

    def rotary(self, x, cos, sin):
        return self.get("rotary")(x, cos, sin)

    def loss(self, logits, labels, tp_group=None, vocab_size: int | None = None):
        return self.get("loss")(logits, labels, tp_group, vocab_size)

    def __repr__(self) -> str:
        return f"Kernels({self.selection})"
