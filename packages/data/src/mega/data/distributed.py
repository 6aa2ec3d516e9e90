"""Who builds the dataset indices: rank 0 first, then, after a barrier, everyone else.

``RankContext`` is passed in explicitly (no globals); :func:`current_rank_context` reads
torch.distributed if, and only if, the program already initialised it, so that plain data tools
never import torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RankContext:
    rank: int = 0
    barrier: Callable[[], None] = lambda: None


def current_rank_context() -> RankContext:
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return RankContext(torch.distributed.get_rank(), torch.distributed.barrier)
    return RankContext()
