"""A collective that a rank never joins fails, once the process group's timeout (what
--distributed-timeout-minutes sets) has passed, with one line naming the operation (issue 15, item 6)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mega.testing.distributed import DistributedWorld
from mega.train.collective_timeout import describe_timeout


def all_reduce_that_rank_1_skips(minutes: float):
    if dist.get_rank() == 1:
        time.sleep(4)  # hung, as far as rank 0 can tell
        return None
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as error:
        return describe_timeout(error, minutes), time.monotonic() - started
    return "completed", None


def test_a_collective_a_peer_never_joins_is_named_after_the_timeout():
    with DistributedWorld(2, timeout_s=1.5) as world:  # the group's timeout: 1.5 s = 0.025 minutes
        (message, waited), _ = world.run(all_reduce_that_rank_1_skips, 0.025, timeout_s=60)
    assert 1.0 < waited < 4.0
    assert message.startswith("all_reduce did not complete within --distributed-timeout-minutes 0.025: "
                              "a peer rank is hung, stopped or dead (")
    assert describe_timeout(RuntimeError("CUDA out of memory"), 10) is None  # other errors pass through
