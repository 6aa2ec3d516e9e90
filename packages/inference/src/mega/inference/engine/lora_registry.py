"""The LoRA adapters a server serves beside its base, each a slot of the model's adapter stacks
(:mod:`mega.models.lora.multi`), chosen per request by name (``mega serve --lora-modules``).

A request holds its adapter (:meth:`AdapterRegistry.acquire`) until it is answered
(:meth:`AdapterRegistry.release`); its rows take the adapter's slot in every forward
(:func:`slot_of`) and its prompt's prefix-cache keys start from the adapter's ``salt``, so a
prefix computed under one adapter never serves another (nor the base). Unloading an adapter that
requests hold takes its name away at once (new requests get 404) and frees its slot when the
last of them is answered; a slot is never reused while a running request reads it. Every load
gets a new salt, so an adapter loaded again under the same name never meets the old one's
cached prefixes.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass


class AdapterError(ValueError):
    """An adapter cannot be loaded or unloaded as asked; the message names the problem."""


class UnknownAdapter(AdapterError):
    """No adapter (nor the base) goes by that name."""


@dataclass(eq=False)
class ServedAdapter:
    name: str
    path: str
    slot: int  # in the model's adapter stacks (0 is the base)
    salt: bytes  # where its prompts' prefix-cache keys start
    holders: int = 0  # requests in flight that take it
    unloaded: bool = False


def slot_of(sequence) -> int:
    """The adapter slot a loop's sequence takes (0: the base)."""
    adapter = sequence.request.adapter
    return 0 if adapter is None else adapter.slot


def prefix_salt(request) -> bytes:
    """Where the request's prefix-cache keys start: its adapter's salt, empty for the base."""
    return b"" if request.adapter is None else request.adapter.salt


class AdapterRegistry:
    """Names to slots. ``lora``: the model's :class:`~mega.models.lora.multi.MultiLoRA`;
    ``read(path)``: an adapter directory's weights for this base (raising ``ValueError`` naming
    the problem); ``allow_runtime_updates``: whether :meth:`load` and :meth:`unload` may run
    once serving (``--allow-runtime-lora-updates``)."""

    def __init__(self, lora, read: Callable, allow_runtime_updates: bool = False):
        self.lora, self.read, self.allow_runtime_updates = lora, read, allow_runtime_updates
        self._by_name: dict[str, ServedAdapter] = {}
        self._free = list(range(lora.max_loras, 0, -1))  # the lowest slot first
        self._loading: set[str] = set()  # names being read now
        self._lock = threading.Lock()
        self._loads = itertools.count(1)

    @property
    def adapters(self) -> list[ServedAdapter]:
        with self._lock:
            return list(self._by_name.values())

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._by_name

    def load(self, name: str, path: str, replace: bool = False, weights=None) -> ServedAdapter:
        """Read ``path`` (unless its ``weights`` are given) and serve it as ``name`` (``replace``:
        in place of the adapter of that name, which keeps serving the requests that hold it until
        they are answered)."""
        with self._lock:
            if name in self._by_name and not replace:
                raise AdapterError(f"lora_name: an adapter named {name!r} is loaded already (unload it first)")
            if name in self._loading:
                raise AdapterError(f"lora_name: an adapter named {name!r} is being loaded now")
            if not self._free:
                raise AdapterError(f"no free adapter slot: all {self.lora.max_loras} are taken (--max-loras); "
                                   "unload one first")
            slot = self._free.pop()
            self._loading.add(name)
        try:
            self.lora.write(slot, self.read(path) if weights is None else weights)
        except ValueError as error:
            with self._lock:
                self._free.append(slot)
                self._loading.discard(name)
            raise AdapterError(f"lora_path {path}: {error}") from None
        adapter = ServedAdapter(name, str(path), slot, f"lora:{next(self._loads)}:".encode())
        with self._lock:
            self._loading.discard(name)
            old = self._by_name.get(name)
            if old is not None:
                self._take_away(old)
            self._by_name[name] = adapter
        return adapter

    def unload(self, name: str) -> bool:
        """Stop serving ``name``; returns whether requests still hold it (its slot is freed when
        the last is answered)."""
        with self._lock:
            adapter = self._by_name.get(name)
            if adapter is None:
                raise UnknownAdapter(f"lora_name: no adapter named {name!r} is loaded")
            self._take_away(adapter)
            return adapter.holders > 0

    def acquire(self, name: str) -> ServedAdapter:
        with self._lock:
            adapter = self._by_name.get(name)
            if adapter is None:
                raise UnknownAdapter(name)
            adapter.holders += 1
            return adapter

    def release(self, adapter: ServedAdapter) -> None:
        with self._lock:
            adapter.holders -= 1
            if adapter.unloaded and adapter.holders == 0:
                self._free.append(adapter.slot)

    def _take_away(self, adapter: ServedAdapter) -> None:
        """(Under the lock.) The name goes now; the slot once nobody holds it."""
        del self._by_name[adapter.name]
        adapter.unloaded = True
        if adapter.holders == 0:
            self._free.append(adapter.slot)
