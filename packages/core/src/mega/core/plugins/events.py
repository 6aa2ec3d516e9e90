"""Per-run event dispatch: the training loop and schedules fire, callbacks listen."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import pluggy

from mega.core.plugins import hookspecs


class Events:
    """The event hooks of one run.

    ``events.hook.on_step_end(run=..., iteration=..., metrics=...)`` calls every listener that
    implements it. With no listeners a call costs a few microseconds, so schedules fire events
    unconditionally.
    """

    def __init__(self, listeners: Iterable[Any] = ()):
        self._manager = pluggy.PluginManager(hookspecs.PROJECT)
        self._manager.add_hookspecs(hookspecs.EventSpecs)
        for listener in listeners:
            self.add(listener)

    @property
    def hook(self):
        return self._manager.hook

    @contextlib.contextmanager
    def forward_context(self, microbatch: int, chunk: int) -> Iterator[None]:
        """Every listener's ``forward_context`` entered around one micro-batch's forward, the
        first registered outermost (pluggy calls the last registered first)."""
        with contextlib.ExitStack() as stack:
            for context in reversed(self.hook.forward_context(microbatch=microbatch, chunk=chunk)):
                stack.enter_context(context)
            yield

    def add(self, listener: Any) -> None:
        """Register ``listener``: its ``on_*`` hook implementations take part from now on."""
        self._manager.register(listener)

    def remove(self, listener: Any) -> None:
        self._manager.unregister(listener)

    def hook_options(self, listener: Any) -> dict[str, dict]:
        """``{method name: pluggy's hookimpl options}`` of ``listener``'s hook implementations."""
        options = {name: self._manager.parse_hookimpl_opts(listener, name) for name in dir(listener)}
        return {name: opts for name, opts in options.items() if opts is not None}

    def listeners(self) -> list[Any]:
        """The listeners; one registered behind a wrapper (mega-train's guard) names it as ``.listener``."""
        return [getattr(plugin, "listener", plugin) for plugin in self._manager.get_plugins()]
