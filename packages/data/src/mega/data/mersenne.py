"""The C++ standard library's ``std::mt19937`` and ``std::mt19937_64``, seeded as C++ seeds them.

Megatron's sentence-pair sample index (``helpers.build_mapping``, C++) draws its target lengths
from ``std::mt19937(seed)`` and shuffles with ``std::mt19937_64(seed + 1)``; reproducing its
samples means reproducing those streams. numpy's MT19937 is the same 32-bit generator, so that
one only needs C++'s seeding; the 64-bit generator is written out here (its state update is
vectorised with numpy, its outputs come in blocks of 312).
"""

from __future__ import annotations

import numpy as np

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


class MT19937:
    """``std::mt19937(seed)``: ``next()`` gives the raw 32-bit outputs in order."""

    def __init__(self, seed: int, block: int = 4096):
        state = [seed & _MASK32]
        for i in range(1, 624):
            previous = state[-1]
            state.append((1812433253 * (previous ^ (previous >> 30)) + i) & _MASK32)
        self._generator = np.random.MT19937()
        # pos 624: the first draw regenerates the whole state, as C++ does.
        self._generator.state = {"bit_generator": "MT19937",
                                 "state": {"key": np.array(state, dtype=np.uint32), "pos": 624}}
        self._block = block
        self._buffer: list[int] = []

    def next(self) -> int:
        if not self._buffer:
            self._buffer = self._generator.random_raw(self._block).tolist()[::-1]
        return self._buffer.pop()


class MT19937_64:
    """``std::mt19937_64(seed)``: ``next()`` gives the raw 64-bit outputs in order."""

    N, M = 312, 156

    def __init__(self, seed: int):
        state = [seed & _MASK64]
        for i in range(1, self.N):
            previous = state[-1]
            state.append((6364136223846793005 * (previous ^ (previous >> 62)) + i) & _MASK64)
        self._state = np.array(state, dtype=np.uint64)
        self._buffer: list[int] = []

    def _twist(self) -> None:
        mt, n, m = self._state, self.N, self.M
        upper, lower = np.uint64(0xFFFFFFFF80000000), np.uint64(0x7FFFFFFF)
        matrix = np.uint64(0xB5026F5AA96619E9)

        def mixed(current, following, partner):
            x = (current & upper) | (following & lower)
            return partner ^ (x >> np.uint64(1)) ^ np.where(x & np.uint64(1), matrix, np.uint64(0))

        # i < n - m reads old words only; n - m <= i < n - 1 reads words the first part renewed.
        mt[: n - m] = mixed(mt[: n - m], mt[1 : n - m + 1], mt[m:])
        mt[n - m : n - 1] = mixed(mt[n - m : n - 1], mt[n - m + 1 :], mt[: m - 1])
        mt[n - 1 :] = mixed(mt[n - 1 :], mt[:1], mt[m - 1 : m])

    def next(self) -> int:
        if not self._buffer:
            self._twist()
            y = self._state.copy()
            y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
            y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
            y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
            y ^= y >> np.uint64(43)
            self._buffer = y.tolist()[::-1]
        return self._buffer.pop()
