"""Dense peak TFLOP/s of known accelerators, for MFU (vendor datasheets, without sparsity)."""

from __future__ import annotations

import torch

# name fragment -> (bf16/fp16 peak, tf32 peak); SXM parts. Checked in order: H100 PCIe first.
PEAK_TFLOPS = [
    ("H100 PCIe", (756.0, 378.0)),
    ("H100", (989.0, 494.0)),
    ("H200", (989.0, 494.0)),
    ("GH200", (989.0, 494.0)),
    ("B200", (2250.0, 1100.0)),
    ("A100", (312.0, 156.0)),
]


def peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None = None) -> float | None:
    """The device's dense peak for ``dtype``; None on a CPU or an unknown GPU (no MFU then)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    return peak_tflops_of(torch.cuda.get_device_name(device), fp32=dtype == torch.float32)


def peak_tflops_of(gpu_name: str, fp32: bool = False) -> float | None:
    """The dense peak of a GPU named like ``NVIDIA H100 80GB HBM3`` (or just ``H100``)."""
    for fragment, (half, tf32) in PEAK_TFLOPS:
        if fragment.lower() in gpu_name.lower():
            return tf32 if fp32 else half
    return None
