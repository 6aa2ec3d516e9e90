"""The commands mega's own packages bring, by package: with the package missing, ``mega train`` names
what to install instead of calling the command unknown, and ``mega --help`` says what is not there.

Only names: the core imports none of these packages. tests/test_workspace.py checks the table
against what the installed packages really register.
"""

from __future__ import annotations

from importlib import metadata

from mega.core.plugins.install_hint import repository_package

# distribution -> (its folder in the repository, the commands (or command groups) it registers)
PACKAGES = {
    "mega-train": ("packages/train", ("train", "plan", "doctor", "bench", "checkpoint", "plugins new", "launch")),
    "mega-data": ("packages/data", ("preprocess", "merge-datasets")),
    "mega-ckpt-convert": ("packages/ckpt-convert", ("convert", "lora")),
    "mega-inference": ("packages/inference", ("generate", "serve", "eval", "embed")),
    "mega-rl": ("packages/rl", ("rl",)),
}


def missing_command(argv: list[str], registered: set[str]) -> tuple[str, str] | None:
    """(command, distribution) when ``argv``'s leading words spell a command of one of mega's
    packages that nothing registered here; None otherwise."""
    for length in range(len(argv), 0, -1):
        words = " ".join(argv[:length])
        for distribution, (_, commands) in PACKAGES.items():
            if words in commands and not _registered(words, registered):
                return words, distribution
    return None


def missing_line(command: str, distribution: str, disabled: list[str]) -> str:
    """Why ``mega COMMAND`` is not there: ``distribution`` is not installed (how to install it), or
    its plugin is disabled here."""
    try:
        entry_points = metadata.distribution(distribution).entry_points.select(group="mega")
    except metadata.PackageNotFoundError:
        path = PACKAGES[distribution][0]
        return f"`mega {command}` comes with {distribution}, which is not installed: {repository_package(distribution, path)}"
    names = [entry.name for entry in entry_points if entry.name in disabled]
    if names:
        return (f"`mega {command}` comes with {distribution}, whose plugin {', '.join(names)} is disabled here "
                "(MEGA_DISABLE_PLUGINS / MEGA_LOAD_PLUGINS)")
    return f"`mega {command}` comes with {distribution}, which is installed but did not register it (see `mega plugins`)"


def absent(registered: set[str]) -> list[str]:
    """``mega-train: train, plan, ...`` for each package none of whose commands is registered here."""
    return [f"{distribution}: {', '.join(commands)}" for distribution, (_, commands) in PACKAGES.items()
            if not any(_registered(command, registered) for command in commands)]


def _registered(command: str, registered: set[str]) -> bool:
    """``command`` is a registered command, or a group of them (``bench``: ``bench comm``...)."""
    return any(name == command or name.startswith(command + " ") for name in registered)
