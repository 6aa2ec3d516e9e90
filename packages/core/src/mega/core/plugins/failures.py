"""How a plugin that failed to load is reported: one line where the user meets it, the whole
traceback on request (``MEGA_PLUGIN_TRACEBACKS=1`` or ``mega plugins --traceback``)."""

from __future__ import annotations

import os
import traceback as traceback_module
from dataclasses import dataclass

TRACEBACKS_VARIABLE = "MEGA_PLUGIN_TRACEBACKS"


@dataclass
class FailedPlugin:
    """What :func:`failure_line` reads; :class:`mega.core.plugins.PluginInfo` has the same fields."""

    name: str
    distribution: str
    version: str
    error: str
    traceback: str = ""

    @classmethod
    def from_error(cls, name: str, distribution: str, version: str, error: BaseException) -> FailedPlugin:
        return cls(name, distribution, version, describe(error), format_traceback(error))


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def format_traceback(error: BaseException) -> str:
    return "".join(traceback_module.format_exception(type(error), error, error.__traceback__))


def tracebacks_wanted(environ=None) -> bool:
    return (os.environ if environ is None else environ).get(TRACEBACKS_VARIABLE, "") not in ("", "0")


def failure_line(failed, with_traceback: bool | None = None, which: bool = False) -> str:
    """``plugin X (dist Y) failed to load: <error>`` (``which``: ``plugin X (dist Y), which failed
    to load: ...``), with the traceback when asked for."""
    line = f"plugin {failed.name} ({failed.distribution}){', which' if which else ''} failed to load: {failed.error}"
    if with_traceback is None:
        with_traceback = tracebacks_wanted()
    if with_traceback and failed.traceback:
        line += "\n" + failed.traceback.rstrip()
    elif failed.traceback:
        line += f" ({TRACEBACKS_VARIABLE}=1 shows the traceback)"
    return line
