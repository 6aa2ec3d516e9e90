"""torchao's import-time noise, sent to the debug log: under a torch it was not built against
(torchao 0.18 under torch 2.13), importing it warns "Failed to load .../torchao/_C_mxfp8...so"
and "..._C_cutlass_90a.abi3.so" (kernels mega-torchao does not use: its FP8 runs on
``torch._scaled_mm``) and torch's pytree warns that torchao registers its Enums as constants.
Every `mega` command imports it (``mega plugins`` asks the backend whether it is available), so
those lines would open every output. Only these messages are lowered to DEBUG; any other warning
of torchao or torch still shows.
"""

from __future__ import annotations

import logging


def _failed_torchao_extension(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return message.startswith("Failed to load ") and "torchao" in message and "/_C_" in message


def _torchao_enum_registered_with_pytree(record: logging.LogRecord) -> bool:
    return (isinstance(record.msg, str) and "is an Enum subclass and is now natively supported" in record.msg
            and any(getattr(arg, "__module__", "").startswith("torchao") for arg in record.args or ()))


class _ToDebug(logging.Filter):
    def __init__(self, matches):
        super().__init__()
        self.matches = matches

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and self.matches(record):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            # Handlers below DEBUG's level still see it; the logger's own level decides as for any debug line.
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


NOISE = {"torchao": _failed_torchao_extension, "torch.utils._pytree": _torchao_enum_registered_with_pytree}


def quiet_torchao_import_noise() -> None:
    """Install the filters (once): the loggers torchao's and torch's import-time warnings use."""
    for name, matches in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _ToDebug) for existing in logger.filters):
            logger.addFilter(_ToDebug(matches))
