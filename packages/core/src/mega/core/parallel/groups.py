"""``ParallelGroups``: every process group of a layout, built once and passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mega.core.parallel.config import ParallelConfig
from mega.core.parallel.layout import embedding_ranks, rank_groups
from mega.core.process_group import collective_timeout


@dataclass(frozen=True)
class Group:
    """One parallel group as seen from this process."""

    name: str
    ranks: tuple[int, ...]  # global ranks, in group order
    rank: int  # this process's index in ``ranks``
    group: Any  # torch ProcessGroup; None only when torch.distributed is not initialised

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


class ParallelGroups:
    """The tensor, context, expert, data and pipeline groups of this process.

    Built collectively: every rank constructs it with the same config, in the same order. When
    torch.distributed is not initialised it describes a single process, so a model runs the same
    code on one process as in a layout (every group then has size 1 and collectives are no-ops).

    Dense layers use the ranks laid out ``tp-cp-dp-pp``; expert layers reuse the same world laid
    out ``etp-ep-dp-pp`` (experts are spread over what is data and context parallel for dense
    layers, and over tp/etp more ranks when --expert-tensor-parallel-size is smaller than tp), as
    Megatron-Core does: ``etp``, ``ep`` and ``expert_dp`` are that layout's groups.
    """

    def __init__(self, config: ParallelConfig, backend: str | None = None, *,
                 world_size: int | None = None, rank: int | None = None):
        """``world_size`` and ``rank`` given: the layout as rank ``rank`` of that world sees it,
        without process groups (to build shapes or plan memory; nothing communicates)."""
        planning = world_size is not None
        initialized = not planning and dist.is_available() and dist.is_initialized()
        self.world_size = world_size if planning else dist.get_world_size() if initialized else 1
        self.global_rank = (rank or 0) if planning else dist.get_rank() if initialized else 0
        self._connected = initialized
        config.validate(self.world_size)
        self.config = config
        self.backend = dist.get_backend() if initialized else "none"
        dp = config.data_parallel_size(self.world_size)
        dense = {"tp": config.tp, "cp": config.cp, "dp": dp, "pp": config.pp}
        etp = config.expert_tp
        expert = {"tp": etp, "ep": config.ep, "dp": self.world_size // (etp * config.ep * config.pp), "pp": config.pp}

        self._backend = backend
        self.tp = self._build("tp", rank_groups(dense, "tp"))
        self.cp = self._build("cp", rank_groups(dense, "cp"))
        self.dp = self._build("dp", rank_groups(dense, "dp"))
        # Gradients of dense parameters are averaged over data- and context-parallel ranks alike.
        self.dp_cp = self._build("dp_cp", rank_groups(dense, "dp-cp"))
        self.pp = self._build("pp", rank_groups(dense, "pp"))
        self.embedding = self._build(
            "embedding", [embedding_ranks(ranks) for ranks in rank_groups(dense, "pp")]
        )
        self.ep = self._build("ep", rank_groups(expert, "ep"))
        self.expert_dp = self._build("expert_dp", rank_groups(expert, "dp"))
        # The experts' tensor group: the tensor group itself unless --expert-tensor-parallel-size differs.
        self.etp = self.tp if etp == config.tp else self._build("etp", rank_groups(expert, "tp"))

    def _build(self, name: str, all_ranks: list[list[int]]) -> Group:
        mine = [ranks for ranks in all_ranks if self.global_rank in ranks]
        # Every rank must call new_group for every group, in the same order, even ones it is not in.
        handles = {}
        if self._connected and self.world_size > 1:
            for ranks in _unique(all_ranks):
                handles[tuple(ranks)] = dist.new_group(ranks, backend=self._backend, timeout=collective_timeout())
        if not mine:  # e.g. a middle pipeline stage is in no embedding group
            return Group(name, (), -1, None)
        ranks = tuple(mine[0])
        return Group(name, ranks, ranks.index(self.global_rank), handles.get(ranks))

    @property
    def is_pipeline_last(self) -> bool:
        return self.pp.is_last

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors live: its GPU under NCCL (or a lone process with a GPU),
        the CPU under gloo or without one."""
        if self.backend == "nccl" or (self.backend == "none" and torch.cuda.is_available()):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def describe(self) -> str:
        parts = [f"{g.name}={g.size}" for g in (self.tp, self.cp, self.ep, self.dp, self.pp)]
        return f"rank {self.global_rank}/{self.world_size}: " + " ".join(parts)

    def __repr__(self) -> str:
        return f"ParallelGroups({self.describe()})"


def _unique(groups: list[list[int]]) -> list[list[int]]:
    seen, out = set(), []
    for ranks in groups:
        if tuple(ranks) not in seen:
            seen.add(tuple(ranks))
            out.append(ranks)
    return out
