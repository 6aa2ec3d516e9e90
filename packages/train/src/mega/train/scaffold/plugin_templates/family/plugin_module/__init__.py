"""plugin_name: GPT with a ReLU MLP (registered by import path: `mega --help` imports no torch for it)."""

from mega.core.plugins import hookimpl


@hookimpl
def register_models(register):
    register("plugin_name", "plugin_module.family:FAMILY", "GPT with a ReLU MLP")
