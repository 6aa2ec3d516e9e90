"""Parallel layouts: the config, the rank arithmetic and the process groups; tensor parallelism."""

from mega.core.parallel.collectives import CommCounter
from mega.core.parallel.config import ParallelConfig, ParallelConfigError
from mega.core.parallel.cross_entropy import vocab_parallel_cross_entropy
from mega.core.parallel.groups import Group, ParallelGroups
from mega.core.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mega.core.parallel.layout import ORDER, rank_groups
from mega.core.parallel.random import RNGStatesTracker, seed_parallel_rng
from mega.core.parallel.tensor_parallel import apply_tensor_parallel

__all__ = [
    "ORDER",
    "ColumnParallelLinear",
    "CommCounter",
    "Group",
    "ParallelConfig",
    "ParallelConfigError",
    "ParallelGroups",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "rank_groups",
    "seed_parallel_rng",
    "vocab_parallel_cross_entropy",
]
