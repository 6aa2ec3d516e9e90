"""Parallel layouts: the config, the rank arithmetic and the process groups."""

from mega.core.parallel.config import ParallelConfig, ParallelConfigError
from mega.core.parallel.groups import Group, ParallelGroups
from mega.core.parallel.layout import ORDER, rank_groups

__all__ = ["ORDER", "Group", "ParallelConfig", "ParallelConfigError", "ParallelGroups", "rank_groups"]
