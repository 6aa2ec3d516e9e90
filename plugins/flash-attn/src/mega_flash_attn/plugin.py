"""Registers the ``flash-attn`` kernel backend (by import path: listing plugins imports no torch)."""

from mega.core.plugins import hookimpl


@hookimpl
def register_kernel_backends(register):
    register("flash-attn", "mega_flash_attn.backend:BACKEND",
             "flash-attention 2 (3 on Hopper): attention, packed sequences, block_attention with the log-sum-exp")
