"""``mega train --nnodes N --node-rank I --master-addr A --master-port P``: one node's part of a job
that spans several machines, with torchrun's flag names and torchrun's mechanism.

Each node runs one launcher, which runs torch's elastic agent; the agents meet in a c10d rendezvous
whose store node 0 hosts at ``A:P`` (the other nodes connect to it), agree on the world, and start
their local ranks (``--nproc-per-node``) with the environment torchrun gives them: ``RANK``,
``LOCAL_RANK``, ``GROUP_RANK`` (the node's rank in the job) and ``GROUP_WORLD_SIZE`` (the number of
nodes). ``--nnodes MIN:MAX`` makes the membership elastic, as torchrun's does.
"""

from __future__ import annotations

import dataclasses
import os

# The rendezvous's name for the job: every node's agent must give the same one (torchrun's --rdzv-id
# defaults to a constant too); the endpoint already tells jobs apart.
RUN_ID = "mega"


@dataclasses.dataclass(frozen=True)
class Nodes:
    """Where this node stands in a multi-node job: how many nodes may take part, which one this is,
    and where node 0 hosts the rendezvous."""

    min_nodes: int
    max_nodes: int
    node_rank: int
    master_addr: str
    master_port: int
    # torchrun's --rdzv-conf: the rendezvous's own settings (last_call_timeout, keep_alive_interval...).
    rendezvous_config: tuple[tuple[str, str], ...] = ()

    def rendezvous_parameters(self):
        # Start-up cost: torch's elastic package, which only a launcher needs.
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        # The host is named, not guessed from the address: on one machine (a test, or a node running
        # two agents) torch's guess would make every agent try to host the store.
        return RendezvousParameters(backend="c10d", endpoint=f"{self.master_addr}:{self.master_port}", run_id=RUN_ID,
                                    min_nodes=self.min_nodes, max_nodes=self.max_nodes, is_host=self.node_rank == 0,
                                    **dict(self.rendezvous_config))


def parse_nodes(nnodes: str, node_rank: int | None, master_addr: str | None, master_port: int | None,
                rdzv_conf: str | None = None) -> Nodes:
    """``--nnodes`` (``N`` or ``MIN:MAX``) and the flags that go with it, checked; ValueError naming
    the flag that is wrong."""
    try:
        low, _, high = nnodes.partition(":")
        min_nodes, max_nodes = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"--nnodes takes N or MIN:MAX (torchrun's form), got {nnodes!r}") from None
    if not 1 <= min_nodes <= max_nodes:
        raise ValueError(f"--nnodes {nnodes}: need 1 <= MIN <= MAX")
    node_rank = 0 if node_rank is None else node_rank
    if not 0 <= node_rank < max_nodes:
        raise ValueError(f"--node-rank {node_rank} is not one of the {max_nodes} nodes (0..{max_nodes - 1})")
    if max_nodes > 1 and (master_addr is None or master_port is None):
        raise ValueError("--nnodes above 1 needs --master-addr and --master-port: node 0's address and a free "
                         "port there, the same on every node")
    config = []
    for setting in filter(None, (rdzv_conf or "").split(",")):
        key, equals, value = setting.partition("=")
        if not equals or not key or key == "is_host":
            raise ValueError(f"--rdzv-conf takes KEY=VALUE,... (torchrun's form; is_host is --node-rank 0's), "
                             f"got {setting!r}")
        config.append((key, value))
    return Nodes(min_nodes, max_nodes, node_rank, master_addr or "127.0.0.1", master_port or 0, tuple(config))


def node_of_this_rank() -> tuple[int, int]:
    """(this process's node, the number of nodes) from torchrun's or SLURM's environment; (0, 1)
    outside a multi-node job."""
    for node, count in (("GROUP_RANK", "GROUP_WORLD_SIZE"), ("SLURM_NODEID", "SLURM_NNODES")):
        if node in os.environ and count in os.environ:
            return int(os.environ[node]), int(os.environ[count])
    return 0, 1


def where(rank: int) -> str:
    """``rank 3 on node 1`` in a multi-node job, ``rank 3`` otherwise: how logs and failure reports
    name a process."""
    node, count = node_of_this_rank()
    return f"rank {rank} on node {node}" if count > 1 else f"rank {rank}"
