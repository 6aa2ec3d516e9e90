"""The `mega` command line: help, dispatch, groups, unknown and broken commands."""

from __future__ import annotations

import json
import subprocess
import sys

from mega.core.cli.main import main
from mega.core.plugins import Command, hookimpl, load_plugins
from mega.core.version import __version__


def plugins_with(commands, failing_plugin=False):
    class Plugin:
        @hookimpl
        def register_commands(self, register):
            for name, command in commands.items():
                register(name, command)

    extra = [("local", Plugin())]
    plugins = load_plugins(environ={"MEGA_LOAD_PLUGINS": ""}, extra=extra)
    if failing_plugin:
        plugins.add_failed("broken", "mega-broken", "9.9", ImportError("no module named 'nothere'"))
    return plugins


def test_version(capsys):
    assert main(["--version"], plugins_with({})) == 0
    assert capsys.readouterr().out.strip() == f"mega {__version__}"


def test_help_lists_every_command_with_its_line_and_broken_plugins(capsys):
    plugins = plugins_with({"hello": Command("greet someone", lambda argv: 0)}, failing_plugin=True)
    assert main(["--help"], plugins) == 0
    out = capsys.readouterr().out
    assert "hello" in out and "greet someone" in out
    assert "plugins  " in out and "list installed plugins" in out
    assert "broken (mega-broken): ImportError: no module named 'nothere'" in out


def test_dispatch_passes_the_remaining_arguments():
    seen = []
    plugins = plugins_with({"tools comm": Command("collectives", lambda argv: seen.append(argv) or 3)})
    assert main(["tools", "comm", "-b", "8"], plugins) == 3
    assert seen == [["-b", "8"]]


def test_a_group_word_alone_lists_its_commands(capsys):
    plugins = plugins_with({"tools comm": Command("collectives", lambda argv: 0)})
    assert main(["tools"], plugins) == 0
    assert "tools comm  collectives" in capsys.readouterr().out


def test_unknown_command_suggests(capsys):
    plugins = plugins_with({"preprocess": Command("tokenize", lambda argv: 0)})
    assert main(["preproces"], plugins) == 2
    assert "unknown command 'preproces'; did you mean preprocess?" in capsys.readouterr().err


def test_a_command_that_fails_to_import_is_an_error_not_a_crash(capsys):
    plugins = plugins_with({"ghost": Command("never loads", "mega_no_such_module:main")})
    assert main(["ghost"], plugins) == 1
    err = capsys.readouterr().err
    assert "command 'ghost': plugin local ((local)) failed to load: ModuleNotFoundError: No module named 'mega_no_such_module'" in err
    # ...and the help still works and still shows it.
    assert main(["--help"], plugins) == 0


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "mega.core.cli.main", *args],
        capture_output=True, text=True, env=env, check=False,
    )


def test_mega_plugins_json_lists_installed_distributions():
    result = run_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    core = next(item for item in listing if item["name"] == "core")
    assert core["distribution"] == "mega-core"
    assert core["version"] == __version__
    assert "plugins" in core["registered"]["command"]
    assert set(core) >= {"name", "distribution", "version", "registered"}


def test_mega_plugins_table():
    result = run_cli("plugins")
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["plugin", "distribution", "version", "registered"]
    assert any(row.split()[:2] == ["core", "mega-core"] for row in rows)


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    # `mega --help | head -1`: the pipe closes before mega writes; deterministic here by closing first.
    for argv in (["--help"], ["plugins", "--json"]):
        process = subprocess.Popen([sys.executable, "-m", "mega.core.cli.main", *argv], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        process.stdout.close()
        error = process.stderr.read()
        assert process.wait() == 141 and error == "", error  # was: exit 1 and a BrokenPipeError traceback
