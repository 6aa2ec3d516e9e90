"""The flags and ``--config`` tables of a plugin that failed to load, named where the user meets them.

A plugin whose module raised at import registered nothing, so its options class is unknown: mega
cannot list its flags. What is known is its entry-point name, its distribution (name, version and
summary) and its error, and two conventions:

* its table of ``--config`` is ``[ENTRY-POINT-NAME]`` (docs/plugins.md): ``[step_timer]`` is certainly
  the table of plugin ``step_timer``;
* its flags usually begin with its name (``mega plugins new loss-csv`` declares
  ``--loss-csv-path``): an unknown ``--step-timer-path`` is probably a flag of ``step_timer`` (or of
  distribution ``mega-step-timer``).

So an unknown flag or table names the plugin it probably belongs to and that plugin's error, and
any other unknown flag still lists the plugins that failed (their flags are missing too);
``mega train --help`` has a section per failed plugin saying what is missing and why.
"""

from __future__ import annotations

import importlib.metadata

from mega.core.plugins.failures import TRACEBACKS_VARIABLE, failure_line


def _words(name: str) -> str:
    return name.lower().replace("_", "-")


def flag_prefixes(info) -> list[str]:
    """The flag prefixes that mark a flag as probably the plugin's: ``--step-timer-``, and its
    distribution's name without ``mega-`` (``--loss-csv-`` for mega-loss-csv)."""
    names = {_words(info.name), _words(info.distribution).removeprefix("mega-")}
    return sorted(f"--{name}-" for name in names if name and not name.startswith("("))


def _owner(flag: str, failed: list) -> list:
    return [info for info in failed if any(flag.startswith(prefix) for prefix in flag_prefixes(info))]


class FailedPluginOptions:
    """What ``mega.core.config.parse`` appends to an unknown flag or table (``hint`` and the
    ``certain``-ty that makes a did-you-mean of known names pointless)."""

    def __init__(self, plugins):
        self.failed = plugins.failed()

    def flag(self, flag: str) -> tuple[str, bool]:
        owners = _owner(flag, self.failed)
        if owners:
            return "".join(f"; probably a flag of {failure_line(info, which=True)}" for info in owners), True
        return "".join(f"; {failure_line(info)} (its flags are missing; {flag} may be one)"
                       for info in self.failed), False

    def section(self, section: str) -> tuple[str, bool]:
        owners = [info for info in self.failed if info.name == section]
        if owners:
            return "".join(f"; the table of {failure_line(info, which=True)}" for info in owners), True
        return "".join(f"; {failure_line(info)} (its table [{info.name}] is missing)" for info in self.failed), False


def add_failed_plugins_help(parser, plugins) -> None:
    """One ``--help`` section per plugin that failed to load: what it would have added, as far as
    it can be known, and its error."""
    for info in plugins.failed():
        summary = _summary(info.distribution)
        parser.add_argument_group(
            f"plugin {info.name} ({f'{info.distribution} {info.version}'.strip()}): FAILED TO LOAD",
            (f"{summary}. " if summary else "")
            + f"Its flags (probably {', '.join(p + '*' for p in flag_prefixes(info))}) and its [{info.name}] "
            f"table of --config are missing, because: {info.error}. {TRACEBACKS_VARIABLE}=1 or "
            f"`mega plugins --traceback` shows the traceback; MEGA_DISABLE_PLUGINS={info.name} trains without it.")


def _summary(distribution: str) -> str:
    """The distribution's one-line summary (its pyproject ``description``), when it is installed."""
    try:
        return (importlib.metadata.metadata(distribution).get("Summary") or "").strip().rstrip(".")
    except importlib.metadata.PackageNotFoundError:
        return ""
