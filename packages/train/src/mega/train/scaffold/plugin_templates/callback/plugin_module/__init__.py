"""plugin_name: writes each step's loss to a CSV file (`mega train --plugin_flag FILE`)."""

from __future__ import annotations

from dataclasses import dataclass

from mega.core.config import option
from mega.core.plugins import hookimpl

PLUGIN = "plugin_module"  # the entry-point name: run_config.plugins[PLUGIN], the [plugin_module] TOML table


@dataclass
class Options:
    """The flags this plugin adds to `mega train`, declared as the core declares its own."""

    plugin_field: str | None = option(None, "write each step's loss to this CSV file")


class LossCsv:
    """One run's listener: implements the event hooks it needs (docs/plugins.md lists them all)."""

    def __init__(self, path: str):
        self.path = path

    @hookimpl
    def on_train_start(self, run):
        if run.is_logging_rank:  # every rank gets the events; one writes
            with open(self.path, "w", encoding="utf-8") as handle:
                handle.write("iteration,loss\n")

    @hookimpl
    def on_step_end(self, run, iteration, metrics):
        if run.is_logging_rank:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(f"{iteration},{metrics['loss']}\n")


def make_listener(run_config):
    """Called once per run; None keeps the callback out of runs that did not ask for it."""
    options = run_config.plugins.get(PLUGIN, Options())
    return LossCsv(options.plugin_field) if options.plugin_field else None


@hookimpl
def register_callbacks(register):
    register("plugin_name", make_listener, "write each step's loss to a CSV file", options=Options)
