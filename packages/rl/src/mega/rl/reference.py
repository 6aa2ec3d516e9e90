"""The reference policy of the KL term (``--grpo-kl-beta``): the policy as the run started.

Two kinds, chosen by :func:`reference_for`:

* :class:`FrozenCopy`: a copy of this rank's parameters and persistent buffers, taken before the
  first update, in the training layout (the same shards), with no optimizer state and no
  gradients. Its log-probabilities are the policy's own forward (``PolicyEngine.logprobs``, every
  layout it supports) with the copy's values exchanged into the live tensors in place for the
  duration and back after: nothing is rebuilt, no second module exists, and every pointer the
  trainer or the engine holds (gradient-buffer views, FSDP shards, CUDA graphs) stays valid.
* :class:`AdaptersOff`: under LoRA only the adapters train, so the reference is the same model
  with its adapters switched off (:func:`mega.models.lora.adapters.adapters_disabled`): no copy.

With ``--grpo-kl-beta 0`` there is none (no memory). A copy is saved with each ``mega rl``
checkpoint (``rl_reference/``, mega's checkpoint format: global tensors by their canonical
names, so it loads at another layout) and restored at ``--load``; the adapters-off reference is
the loaded base model itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from mega.core.checkpoint.sharded_io import load_entries, save_entries
from mega.core.checkpoint.state import BUFFER, MODEL, Entries, named_parameters
from mega.models.lora.adapters import LoRALinear, adapters_disabled

REFERENCE_DIR = "rl_reference"


class FrozenCopy:
    """The values of this rank's parameters and persistent buffers when it was made."""

    def __init__(self, chunks: list[torch.nn.Module], tp=None):
        self.chunks, self.tp = chunks, tp
        params, duplicates = named_parameters(chunks)
        buffers = {name: buffer for name, buffer in named_parameters(chunks, buffers=True)[0].items()
                   if buffer.is_floating_point()}
        # (entry key, the live tensor, its copy); a tied copy on a second chunk of this rank gets its own
        self.pairs = [(MODEL + name, param, _copy(param)) for name, param in params.items()]
        self.pairs += [(BUFFER + name, buffer, _copy(buffer)) for name, buffer in buffers.items()]
        self.pairs += [(None, copy, _copy(copy)) for _, copy in duplicates]

    @property
    def nbytes(self) -> int:
        return sum(copy.numel() * copy.element_size() for _, _, copy in self.pairs)

    @torch.no_grad()
    def _exchange(self) -> None:
        for _, live, copy in self.pairs:
            held = live.detach().clone()
            live.detach().copy_(copy)
            copy.copy_(held)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The policy's tensors hold the reference's values for the duration."""
        self._exchange()
        try:
            yield
        finally:
            self._exchange()

    def logprobs(self, policy, batch: Mapping) -> list[torch.Tensor]:
        with self.active():
            return policy.logprobs(batch)

    def _entries(self) -> Entries:
        entries = Entries()
        for key, live, copy in self.pairs:
            if key is not None:
                entries.add(key, copy, live, self.tp)
        return entries

    def save(self, directory: Path) -> None:
        save_entries(Path(directory) / REFERENCE_DIR, self._entries().entries)

    def load(self, directory: Path) -> None:
        path = Path(directory) / REFERENCE_DIR
        if not path.is_dir():
            raise FileNotFoundError(f"{directory} has no {REFERENCE_DIR}/ (the KL reference of a mega rl run with "
                                    "--grpo-kl-beta): it was saved by a run without a KL term")
        load_entries(path, self._entries().entries)


class AdaptersOff:
    """The policy with its LoRA adapters switched off: the base model the adapters train on."""

    nbytes = 0

    def __init__(self, chunks: list[torch.nn.Module]):
        self.chunks = chunks

    def logprobs(self, policy, batch: Mapping) -> list[torch.Tensor]:
        with adapters_disabled(*self.chunks):
            return policy.logprobs(batch)

    def save(self, directory: Path) -> None:
        """Nothing to save: the base model is in the policy's checkpoint (its --load)."""

    def load(self, directory: Path) -> None:
        """Nothing to load, as :meth:`save`."""


def has_adapters(chunks: list[torch.nn.Module]) -> bool:
    return any(isinstance(module, LoRALinear) for chunk in chunks for module in chunk.modules())


def reference_for(policy, kl_beta: float) -> FrozenCopy | AdaptersOff | None:
    """The reference a KL weight of ``kl_beta`` needs for ``policy`` (a PolicyEngine, not yet
    updated): none at 0, the adapters switched off under LoRA, else a frozen copy."""
    if not kl_beta:
        return None
    chunks = policy.trainer.chunks
    if has_adapters(chunks):
        return AdaptersOff(chunks)
    return FrozenCopy(chunks, policy.groups.tp)


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone()
