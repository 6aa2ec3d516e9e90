"""plugin_name: a checkpoint format (imported when used)."""

from mega.core.plugins import hookimpl


@hookimpl
def register_checkpoint_formats(register):
    register("plugin_name", "plugin_module.format:FORMAT", "every tensor in one torch.save file, the config in JSON")
