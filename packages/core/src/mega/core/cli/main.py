"""``mega``: dispatches to the sub-commands that installed plugins register.

Commands parse their own arguments; this module only finds the command (the longest registered
name that the leading words spell, so ``mega bench comm`` finds ``"bench comm"``) and runs it.
"""

from __future__ import annotations

import difflib
import os
import signal
import sys

from mega.core.cli.elsewhere import absent, missing_command, missing_line
from mega.core.plugins import PluginError, Plugins, get_plugins
from mega.core.plugins.failures import FailedPlugin, failure_line
from mega.core.plugins.registry import resolve
from mega.core.process_group import distributed_env
from mega.core.rank_exit import end_rank_process, record_failure
from mega.core.version import __version__

USAGE = "usage: mega [--version] [--help] <command> [<args>...]"


def main(argv: list[str] | None = None, plugins: Plugins | None = None) -> int:
    """The ``mega`` console script: run the command; a reader that stops reading (``| head``) is
    not an error of ours, so it ends the command quietly, as SIGPIPE ends a C program; SIGINT
    (Ctrl-C) ends it with one line and 130.

    Run as a program (``argv`` None) in a rank of a distributed job, it ends the process itself
    (:func:`mega.core.rank_exit.end_rank_process`): a finished run must not fail in shutdown."""
    as_rank = argv is None and distributed_env() is not None
    try:
        exit_code = _run(argv, plugins)
        sys.stdout.flush()  # inside the try: the last buffered lines may be the ones nobody reads
    except BrokenPipeError:
        # Python would flush stdout again at exit and print "Exception ignored ... BrokenPipeError".
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        exit_code = 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        # Ctrl-C, or a launcher passing SIGINT on to its ranks: the user asked to stop; a traceback
        # of wherever the run happened to be says nothing more. 130, as a shell reports it.
        print("mega: interrupted by SIGINT", file=sys.stderr, flush=True)
        exit_code = 128 + signal.SIGINT
    if as_rank:
        end_rank_process(exit_code)
    return exit_code


def _run(argv: list[str] | None, plugins: Plugins | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    plugins = get_plugins() if plugins is None else plugins

    if argv[:1] == ["--version"]:
        print(f"mega {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(format_help(plugins))
        return 0

    name, rest = _match_command(plugins, argv)
    missing = missing_command(argv, set(plugins.commands.names()))
    if missing is not None and (name is None or len(name) < len(missing[0])):
        print(f"mega: {missing_line(*missing, plugins.disabled)}", file=sys.stderr)
        return 2
    if name is None:
        group = [n for n in plugins.commands.names() if n.startswith(argv[0] + " ")]
        if group:
            print(format_help(plugins, prefix=argv[0]))
            return 0 if argv[1:2] in ([], ["-h"], ["--help"]) else 2
        print(f"mega: unknown command {argv[0]!r}{_suggest(plugins, argv[0])}{_failed(plugins, argv[0])}",
              file=sys.stderr)
        print(USAGE, file=sys.stderr)
        return 2

    try:
        command = plugins.commands.get(name)
        command_main = resolve(command.main)
    except PluginError as error:
        print(f"mega: {error}", file=sys.stderr)
        return 1
    except (ImportError, AttributeError) as error:
        entry = plugins.commands.entry(name)
        failure = FailedPlugin.from_error(entry.plugin, entry.distribution, entry.version, error)
        print(f"mega: command {name!r}: {failure_line(failure)}", file=sys.stderr)
        return 1
    try:
        exit_code = int(command_main(rest) or 0)
    except BaseException as error:
        record_failure(error.code if isinstance(error, SystemExit) and isinstance(error.code, int) else 1)
        raise
    if exit_code:
        record_failure(exit_code)
    return exit_code


def _match_command(plugins: Plugins, argv: list[str]) -> tuple[str | None, list[str]]:
    for length in range(len(argv), 0, -1):
        candidate = " ".join(argv[:length])
        if candidate in plugins.commands:
            return candidate, argv[length:]
    return None, argv


def _suggest(plugins: Plugins, word: str) -> str:
    tops = sorted({n.split(" ")[0] for n in plugins.commands.names()})
    close = difflib.get_close_matches(word, tops, n=3, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else ""


def _failed(plugins: Plugins, word: str) -> str:
    """The plugins that failed to load: one of them may be the one that provides ``word``."""
    failed = plugins.failed()
    return "".join(f"; {failure_line(info)} (it may provide {word!r})" for info in failed)


def format_help(plugins: Plugins, prefix: str | None = None) -> str:
    lines = [USAGE if prefix is None else f"usage: mega {prefix} <command> [<args>...]", ""]
    if prefix is None:
        lines.append("mega trains and serves transformer language models; commands come from the")
        lines.append("installed mega packages and plugins (see `mega plugins`).")
        lines.append("")
    lines.append("commands:")
    rows = []
    for entry in plugins.commands.entries():
        if prefix is not None and not entry.name.startswith(prefix + " "):
            continue
        rows.append((entry.name, entry.description or _command_help(entry)))
    width = max((len(name) for name, _ in rows), default=0)
    lines += [f"  {name.ljust(width)}  {text}" for name, text in rows]
    missing = absent(set(plugins.commands.names())) if prefix is None else []
    if missing:
        lines += ["", "commands of mega's packages that are not installed (or are disabled) here:"]
        lines += [f"  {line}" for line in missing]
    broken = plugins.failed()
    if broken and prefix is None:
        lines += ["", "plugins that failed to load (their commands are missing):"]
        lines += [f"  {info.name} ({info.distribution}): {info.error}" for info in broken]
        lines.append("  (MEGA_PLUGIN_TRACEBACKS=1 or `mega plugins --traceback` shows the tracebacks)")
    contested = plugins.contested()
    if contested and prefix is None:
        lines += ["", "names two plugins registered (unusable until the newcomer is disabled):"]
        lines += [f"  {message}" for info in contested for message in info.duplicates]
    lines += ["", "Run `mega <command> --help` for a command's options."]
    return "\n".join(lines)


def _command_help(entry) -> str:
    target = entry.target
    return getattr(target, "help", "") if not isinstance(target, str) else ""


if __name__ == "__main__":
    sys.exit(main())
