"""Registers the ``liger`` kernel backend (by import path: listing plugins imports no torch)."""

from mega.core.plugins import hookimpl


@hookimpl
def register_kernel_backends(register):
    register("liger", "mega_liger.backend:BACKEND",
             "Liger Triton kernels: RMSNorm, LayerNorm, RoPE, SwiGLU/GeGLU, fused linear cross-entropy")
