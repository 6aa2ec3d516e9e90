"""plugin_name: a kernel backend filling the `activation` kind (imported when selected)."""

from mega.core.plugins import hookimpl


@hookimpl
def register_kernel_backends(register):
    register("plugin_name", "plugin_module.backend:BACKEND", "hand-written tanh-approximated GELU")
