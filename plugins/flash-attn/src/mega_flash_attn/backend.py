"""The ``flash-attn`` backend: which library serves, and whether it can here.

flash-attention 2 (``flash_attn`` >= 2.7, whose private forward/backward take the log-sum-exp
by keyword) needs an Ampere or newer GPU (compute capability 8.0). On a Hopper GPU (9.x) with
flash-attention 3 installed (its ``flash_attn_interface`` module, built from the repository's
``hopper/`` directory) attention without dropout runs FA3; dropout and ``block_attention``
stay on FA2, which FA3 lacks the dropout and the stable private backward for.
"""

from __future__ import annotations

import importlib

from mega.core.kernel_requirements import GPU, CudaGPU, first_problem, package_problem

MINIMUM_VERSION = "2.7"
MINIMUM_CAPABILITY = (8, 0)
HOPPER = 9


class FlashAttnBackend:
    name = "flash-attn"
    kinds = frozenset({"attention", "block_attention"})

    def __init__(self, gpu: GPU | None = None):
        # The GPU probe; tests replace it (there is no GPU in CI) and nothing else does.
        self.gpu = gpu or CudaGPU()

    def is_available(self) -> tuple[bool, str]:
        return first_problem(
            lambda: package_problem("flash_attn", "flash-attn", MINIMUM_VERSION,
                                    "pip install -c constraints.txt flash-attn --no-build-isolation"),
            lambda: self.gpu.problem(MINIMUM_CAPABILITY),
        )

    def hopper_interface(self):
        """FA3's ``flash_attn_interface`` module when installed and this is a Hopper GPU, else None."""
        capability = self.gpu.capability()
        if capability is None or capability[0] != HOPPER:
            return None
        try:
            return importlib.import_module("flash_attn_interface")
        except ImportError:
            return None

    def component(self, kind: str):
        # optional dependency: the kernel library may be absent; the backend reports it
        from mega_flash_attn.attention import FlashAttention, FlashBlockAttention

        if kind == "attention":
            return FlashAttention(importlib.import_module("flash_attn"), self.hopper_interface())
        if kind == "block_attention":
            return FlashBlockAttention(importlib.import_module("flash_attn"),
                                       importlib.import_module("flash_attn.flash_attn_interface"))
        raise KeyError(kind)


BACKEND = FlashAttnBackend()
