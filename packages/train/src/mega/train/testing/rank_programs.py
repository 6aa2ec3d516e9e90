"""Programs a launcher test runs as its ranks (``launch_job(..., program=(python, "-c", PROGRAM))``):
`mega` with a training step that can take its rank (or its whole node) down at a chosen moment, and
whose rank 0 notes each loss exactly, for tests that compare the losses around a restart."""

from __future__ import annotations

_PROGRAM = """
import os, signal, sys
from mega.train import trainer
step = trainer.Trainer.train_step
def train_step(self, data):
    if {dies_when}:
        {kill_agent}os.kill(os.getpid(), signal.SIGKILL)
    metrics = step(self, data)
    if os.environ['RANK'] == '0':
        with open(os.environ['MEGA_TEST_LOSSES'], 'a') as out:
            out.write(' '.join([*(os.environ[name] for name in {noted!r}), str(self.state.iteration),
                                repr(metrics['loss'])]) + '\\n')
    return metrics
trainer.Trainer.train_step = train_step
from mega.core.cli.main import main
sys.argv = ['mega', *sys.argv[1:]]
sys.exit(main())
"""


def dying_rank(dies_when: str, noted: tuple[str, ...] = ("TORCHELASTIC_RESTART_COUNT",), whole_node: bool = False) -> str:
    """The rank's program: SIGKILLed when ``dies_when`` (a Python expression over ``os.environ`` and
    ``self.state.iteration``) holds as an iteration starts, and with ``whole_node`` its agent first
    (a lost node); rank 0 appends ``<the variables noted> <iteration> <loss>`` to $MEGA_TEST_LOSSES."""
    kill_agent = "os.kill(os.getppid(), signal.SIGKILL); " if whole_node else ""
    return _PROGRAM.format(dies_when=dies_when, kill_agent=kill_agent, noted=list(noted))
