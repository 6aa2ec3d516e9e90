"""Kernel backends: the contract a fast kernel (attention today; norms, fused MLP later) fills.

Models never import a kernel library. They ask for a backend by name, and plugins register
backends through ``register_kernel_backends``: mega-models registers ``sdpa`` (torch's
``scaled_dot_product_attention``), a flash-attn or Transformer Engine plugin registers its own
name, and ``--attention-backend NAME`` picks one without the model changing.

A backend is any object with these attributes; ``kind`` says which contract it fills, so one
registry holds attention, norm and optimizer kernels alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from mega.core.plugins import Plugins


class KernelBackendError(RuntimeError):
    """A backend that is not registered, of the wrong kind, or not usable on this machine."""


@runtime_checkable
class AttentionBackend(Protocol):
    """Causal or full softmax attention over ``[batch, heads, sequence, head_dim]`` tensors.

    ``key``/``value`` may have fewer heads than ``query`` (grouped-query attention): query head
    ``i`` attends with key/value head ``i // (heads // kv_heads)``, the order Megatron's
    per-group QKV layout and Hugging Face's ``repeat_kv`` share. ``softmax_scale=None`` means
    ``1/sqrt(head_dim)``. Dropout on the attention probabilities draws from torch's default RNG
    of the tensors' device, so callers control it with the usual RNG state.
    """

    name: str
    kind: str  # "attention"

    def is_available(self) -> tuple[bool, str]:
        """(True, "") or (False, what is missing: the package, the GPU, the compute capability)."""

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        causal: bool,
        dropout_p: float,
        softmax_scale: float | None,
    ) -> torch.Tensor:
        """Return ``[batch, heads, sequence, head_dim]`` in the query's dtype."""


def get_kernel_backend(kind: str, name: str, plugins: Plugins | None = None) -> Any:
    """The registered backend ``name``, checked to be of ``kind`` and available here."""
    if plugins is None:
        from mega.core.plugins import get_plugins

        plugins = get_plugins()
    backend = plugins.kernel_backends.get(name)  # an unknown name lists the installed ones
    backend_kind = getattr(backend, "kind", None)
    if backend_kind != kind:
        raise KernelBackendError(
            f"kernel backend {name!r} is a {backend_kind!r} backend, not an {kind!r} backend"
        )
    available, missing = backend.is_available()
    if not available:
        raise KernelBackendError(f"{kind} backend {name!r} is not available: {missing}")
    return backend


def get_attention_backend(name: str = "sdpa", plugins: Plugins | None = None) -> AttentionBackend:
    return get_kernel_backend("attention", name, plugins)
