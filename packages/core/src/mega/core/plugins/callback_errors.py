"""A plugin's callback that raises during a run: the error names the plugin, the hook, the exception
and its message, and ``mega train`` ends with its own exit code (:data:`CALLBACK_EXIT_CODE`; 2 is
for bad input, and a callback's crash is not the user's input).

Each listener a plugin's callback factory made is registered behind a :class:`GuardedListener`:
the same hook implementations, each calling the listener's own and turning an exception into
:class:`CallbackError` (the original is its ``__cause__``, its traceback kept). A listener that
raised takes no further part in the run, so its ``on_train_end`` cannot hide the first error.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

from mega.core.plugins.failures import describe, format_traceback
from mega.core.plugins.registry import PluginError

# `mega train`'s exit code when a plugin's callback raised (0 done, 2 bad input, 3 a collective
# timed out; docs/reliability.md lists them all).
CALLBACK_EXIT_CODE = 4


@dataclass(frozen=True)
class CallbackOrigin:
    """Where a listener comes from: the callback's registered name and its plugin."""

    callback: str
    plugin: str
    distribution: str
    version: str

    @classmethod
    def of(cls, entry) -> CallbackOrigin:
        return cls(entry.name, entry.plugin, entry.distribution, entry.version)


class CallbackError(PluginError):
    """``plugin P (dist V): callback 'c' raised in on_step_end at iteration 2: RuntimeError: ...``"""

    def __init__(self, origin: CallbackOrigin, hook: str, error: Exception, iteration: int | None):
        self.origin, self.hook, self.error, self.iteration = origin, hook, error, iteration
        where = f" at iteration {iteration}" if iteration is not None else ""
        super().__init__(f"plugin {origin.plugin} ({f'{origin.distribution} {origin.version}'.strip()}): callback "
                         f"{origin.callback!r} raised in {hook}{where}: {describe(error)}")

    @property
    def traceback(self) -> str:
        return format_traceback(self.error)


class GuardedListener:
    """``listener``'s hook implementations, each raising :class:`CallbackError` for what it raises;
    ``on_error(guard)`` is called first (the events then drop this listener)."""

    def __init__(self, listener: Any, origin: CallbackOrigin, implementations: dict[str, Any], on_error,
                 unguarded: set[str] = frozenset()):
        self.listener = listener
        for hook, method in implementations.items():
            setattr(self, hook, method if hook in unguarded else self._guard(hook, method, origin, on_error))

    def _guard(self, hook: str, method, origin: CallbackOrigin, on_error):
        names = list(inspect.signature(method).parameters)  # pluggy passes them by position

        @functools.wraps(method)  # the same signature and hookimpl marker: pluggy sees the listener's
        def call(*args):
            try:
                return method(*args)
            except Exception as error:
                on_error(self)
                raise CallbackError(origin, hook, error, _iteration(dict(zip(names, args, strict=False)))) from error
        return call


def _iteration(arguments: dict) -> int | None:
    if "iteration" in arguments:
        return arguments["iteration"]
    return getattr(arguments.get("run"), "iteration", None)
