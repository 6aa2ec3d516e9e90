"""What every `mega` command shares: `--json` on each report, no abbreviated flags, exit 2 for a
flag the command refuses (argparse's code), checked through `mega` itself as a user runs it."""

from __future__ import annotations

import pytest

from mega.core.cli.main import main as mega

REPORT_COMMANDS = ["plugins", "doctor", "plan", "bench train", "bench comm", "checkpoint info", "checkpoint verify",
                   "preprocess", "merge-datasets", "generate", "eval"]


def exit_code(argv: list[str]) -> int:
    try:
        return mega(argv)
    except SystemExit as stop:
        return stop.code


@pytest.mark.parametrize("command", REPORT_COMMANDS)
def test_every_report_command_takes_json(command, capsys):
    assert exit_code([*command.split(), "--help"]) == 0
    assert "--json" in capsys.readouterr().out, f"mega {command} --help lists no --json"


@pytest.mark.parametrize("argv,flag", [(["doctor", "--js"], "--js"), (["plan", "--sear"], "--sear"),
                                       (["bench", "train", "--warm", "1"], "--warm")])
def test_abbreviated_flags_are_refused(argv, flag, capsys):
    # Megatron's strictness (allow_abbrev=False), as `mega train`'s: a prefix is an unknown flag.
    assert exit_code(argv) == 2
    assert flag in capsys.readouterr().err
