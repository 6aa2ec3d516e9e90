"""A collective that outlasted ``--distributed-timeout-minutes``, said in one line.

gloo says "Timed out waiting 6000ms for recv operation to complete" and NCCL's watchdog
"Watchdog caught collective operation timeout"; neither says which collective it was or what to
do. The operation is the torch.distributed function the error came out of; which peer did not
arrive this rank cannot know (the local launcher names a stopped rank, see mega.train.launch).
"""

from __future__ import annotations

import traceback

_TIMEOUT_TEXT = ("Timed out waiting", "timed out", "Watchdog caught collective operation timeout")


def describe_timeout(error: BaseException, minutes: float) -> str | None:
    """The message for a collective timeout; None if ``error`` is something else."""
    if not isinstance(error, RuntimeError) or not any(text in str(error) for text in _TIMEOUT_TEXT):
        return None
    operations = [frame.name for frame in traceback.extract_tb(error.__traceback__)
                  if frame.filename.endswith("distributed_c10d.py")]
    operation = operations[0] if operations else "a collective"
    return (f"{operation} did not complete within --distributed-timeout-minutes {minutes:g}: a peer rank is "
            f"hung, stopped or dead ({str(error).splitlines()[0]})")
