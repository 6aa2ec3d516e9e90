"""Registers apex's kernels and its FusedAdam (by import path: listing plugins imports no torch)."""

from mega.core.plugins import hookimpl


@hookimpl
def register_kernel_backends(register):
    register("apex", "mega_apex.backend:NORMS", "apex FusedLayerNorm / FusedRMSNorm")
    register("apex-softmax", "mega_apex.backend:SOFTMAX",
             "attention as matmuls around apex's fused scaled causal softmax (Megatron's unfused path)")


@hookimpl
def register_optimizers(register):
    register("apex-adam", "mega_apex.backend:FUSED_ADAM", "apex FusedAdam (AdamW mode, multi-tensor CUDA kernel)")
