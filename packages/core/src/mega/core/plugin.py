"""What mega-core itself registers, through the same entry point a third party uses."""

from mega.core.plugins import Command, hookimpl


@hookimpl
def register_commands(register):
    register(
        "plugins",
        Command(
            help="list installed plugins and what they registered",
            main="mega.core.cli.plugins_command:main",
        ),
    )


@hookimpl
def register_optimizers(register):
    register("adam", "mega.core.optim.torch_optimizers:adam", "AdamW (decoupled weight decay), Megatron's adam")
    register("sgd", "mega.core.optim.torch_optimizers:sgd", "SGD with momentum")
