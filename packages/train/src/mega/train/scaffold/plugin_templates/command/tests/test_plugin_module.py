"""The installed command runs through `mega` and is listed by `mega --help`."""

import subprocess
import sys


def mega(*args):
    return subprocess.run([sys.executable, "-m", "mega.core.cli.main", *args], capture_output=True, text=True,
                          check=True).stdout


def test_the_command_runs():
    assert mega("plugin_name", "plugin author") == "hello, plugin author\n"
    assert "plugin_name" in mega("--help")
