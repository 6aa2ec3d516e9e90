"""The order interleaved schedules run micro-batches through a rank's model chunks (Megatron's)."""

from __future__ import annotations


def interleaved_forward(k: int, pp: int, vpp: int) -> tuple[int, int]:
    """The ``k``-th forward of a rank as ``(micro-batch, chunk)``: micro-batches go through the
    chunks in groups of ``pp`` (0..pp-1 through chunk 0, then chunk 1, ..., then pp..2pp-1)."""
    group, within = divmod(k, pp * vpp)
    chunk, offset = divmod(within, pp)
    return group * pp + offset, chunk
