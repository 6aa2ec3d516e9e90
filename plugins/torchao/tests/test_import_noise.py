"""mega prints mega's output (issue 53, item 7): torchao's import-time lines ("Failed to load
.../torchao/_C_*.so", torch's pytree warning about torchao's Enums) go to the debug log, and
nothing else of torchao's or torch's is hidden. CPU only."""

from __future__ import annotations

import enum
import logging
import subprocess
import sys

import pytest
from mega_torchao.import_noise import quiet_torchao_import_noise


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def recorded():
    quiet_torchao_import_noise()
    recorder = Recorder()
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    for logger in loggers:
        logger.addHandler(recorder)
    yield recorder
    for logger in loggers:
        logger.removeHandler(recorder)
        logger.setLevel(logging.NOTSET)


class KernelPreference(enum.Enum):  # torchao's Enum, by module, for torch's pytree warning
    AUTO = "auto"


KernelPreference.__module__ = "torchao.quantization.quantize_.common.kernel_preference"


def test_only_the_import_noise_is_lowered_to_debug(recorded):
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    torchao.warning("Failed to load /site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load")
    pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile", KernelPreference)
    assert recorded.records == []
    torchao.warning("Failed to load a model")  # not an extension of torchao's: shown
    pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile", logging.Formatter)
    assert [record.levelname for record in recorded.records] == ["WARNING", "WARNING"]
    torchao.setLevel(logging.DEBUG)  # the debug log has them
    torchao.warning("Failed to load /site-packages/torchao/_C_cutlass_90a.abi3.so: Could not load")
    assert recorded.records[-1].levelname == "DEBUG" and "_C_cutlass_90a" in recorded.records[-1].getMessage()


def test_mega_plugins_prints_no_torchao_noise():
    done = subprocess.run([sys.executable, "-m", "mega.core.cli.main", "plugins"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "torchao" in done.stdout
    assert "Failed to load" not in done.stderr and "Enum subclass" not in done.stderr, done.stderr
