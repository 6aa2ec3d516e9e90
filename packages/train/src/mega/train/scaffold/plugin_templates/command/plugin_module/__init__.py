"""plugin_name: the `mega plugin_name` command (its module is imported only when it runs)."""

from mega.core.plugins import Command, hookimpl


@hookimpl
def register_commands(register):
    register("plugin_name", Command(help="say hello", main="plugin_module.command:main"))
