"""A sliding-window layer's keys in the static cache: a ring of ``window`` positions per slot, so
its memory per sequence is bounded by the window, not by the model's length.

Position ``p`` of a slot lives at ring index ``p % window``; one more index, ``window``, is
scratch, where the keys that must not be kept land (a right-padded prompt's padding, all but the
last ``window`` tokens of a long prefill). A forward reads the ring *before* writing its new keys
(a new key may overwrite a position an earlier new query still sees) and hands attention the
ring's ``window + 1`` keys followed by the new ones, with a mask made from their positions: a
query at ``q`` sees the keys at ``q - window < p <= q``. So the mask carries the window itself
(:attr:`RingLayer.applies_window`) and the attention adds none of its own.

The ring holds the last ``window`` positions of a slot when every earlier position was written
in order, which the decoder loop does (prefills, whole or chunked, then one token a step); a
throw-away decode row (a free slot, a slot whose prompt is not cached yet) writes at its next
position, which its own prefill writes again before anything sees it.
"""

from __future__ import annotations

import torch

from mega.core.kernels import AttentionMask


def ring_mask_and_writes(cached: torch.Tensor, new_tokens: int, window: int, real: torch.Tensor | None,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows with ``cached`` ``[rows]`` tokens bringing ``new_tokens`` (``real`` ``[rows]``: a
    padded row's own): the additive mask ``[rows, 1, new, window + 1 + new]`` over the ring then the
    new keys, and where each new key is written ``[rows, new]``."""
    device = cached.device
    c = cached[:, None]
    ring = torch.arange(window, device=device)[None, :]
    # Index j holds the latest position before `cached` that is j modulo the window (none: < 0).
    ring_positions = c - 1 - torch.remainder(c - 1 - ring, window)
    scratch = torch.full_like(c, -1)
    new = c + torch.arange(new_tokens, device=device)[None, :]  # [rows, new]
    keys = torch.cat([ring_positions, scratch, new], dim=1)[:, None, :]  # [rows, 1, keys]
    queries = new[:, :, None]  # [rows, new, 1]
    visible = (keys >= 0) & (keys <= queries) & (keys > queries - window)
    bias = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    own = real[:, None] if real is not None else torch.full_like(c, new_tokens)
    k = torch.arange(new_tokens, device=device)[None, :]
    kept = (k < own) & (k >= own - window)  # a row's own tokens, the last `window` of them
    writes = torch.where(kept, torch.remainder(new, window), torch.full_like(new, window))
    return bias[:, None], writes


class RingLayer:
    """One sliding-window layer of a :class:`~mega.inference.engine.slot_kv_cache.SlotKVCache`:
    keys and values ``[slots, window + 1, kv heads, head_dim]``."""

    applies_window = True  # the mask it returns hides what is outside the window

    def __init__(self, cache, window: int):
        self.cache, self.window = cache, window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMask]:
        """Store ``key``/``value`` ``[new, rows, kv heads, head_dim]``; return the rows' rings then
        their new keys ``[window + 1 + new, rows, heads, dim]`` and the mask of the window."""
        cache = self.cache
        new, rows, heads, dim = key.shape
        if self.keys is None:
            shape = (cache.slots, self.window + 1, heads, dim)
            self.keys, self.values = key.new_zeros(shape), value.new_zeros(shape)
        mask, writes = cache.rings[self.window]
        held = []
        for pool, tensor in ((self.keys, key), (self.values, value)):
            fresh = tensor.transpose(0, 1)  # [rows, new, heads, dim]
            if cache.rows is None:  # the window of the first slots: a slice, written in place
                ring = pool[:rows]
                held.append(torch.cat([ring, fresh], dim=1).transpose(0, 1))
                ring.scatter_(1, writes[:, :, None, None].expand(rows, new, heads, dim), fresh)
            else:
                held.append(torch.cat([pool[cache.rows], fresh], dim=1).transpose(0, 1))
                pool[cache.rows[:, None], writes] = fresh
        return held[0], held[1], AttentionMask(bias=mask)
