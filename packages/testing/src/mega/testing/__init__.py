"""Test helpers for mega and its plugins: run functions on several gloo ranks from pytest."""

from mega.testing.distributed import DistributedWorld, RankFailed, Worlds, WorldTimeout

__all__ = ["DistributedWorld", "RankFailed", "WorldTimeout", "Worlds"]
