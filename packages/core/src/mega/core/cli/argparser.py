"""The argument parser every ``mega`` command uses: Megatron's strictness, one-line errors.

* No abbreviations (``allow_abbrev=False``, as Megatron sets): ``--lr-decay-styl`` is an unknown
  flag, not a silent prefix of ``--lr-decay-style`` that a later, longer flag could make ambiguous.
* An error is one line naming the problem and where to look, not the whole usage first (which,
  for ``mega train``, is some 80 lines of flags above the one that matters).
"""

from __future__ import annotations

import argparse
import sys


class CommandParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\nsee `{self.prog} --help`\n")

    def exit(self, status: int = 0, message: str | None = None):
        if message:
            sys.stderr.write(message)
        sys.exit(status)
