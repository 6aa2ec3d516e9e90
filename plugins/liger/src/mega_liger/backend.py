"""The ``liger`` backend: Liger-Kernel's Triton kernels, and whether they can run here.

Liger-Kernel is a pure-Python wheel, but its kernels are Triton programs: they need ``triton``
and a CUDA GPU (Triton compiles for compute capability 7.0 and newer). 0.5.3 is the first
release whose RoPE reads per-sequence ``cos``/``sin`` (``[batch, seq, d]``; earlier ones take
the first sequence's positions for every sequence).
"""

from __future__ import annotations

from mega.core.kernel_requirements import GPU, CudaGPU, first_problem, package_problem

MINIMUM_VERSION = "0.5.3"
MINIMUM_CAPABILITY = (7, 0)


class LigerBackend:
    name = "liger"
    kinds = frozenset({"norm", "rotary", "activation", "linear_loss"})

    def __init__(self, gpu: GPU | None = None):
        # The GPU probe; tests replace it (there is no GPU in CI) and nothing else does.
        self.gpu = gpu or CudaGPU()

    def is_available(self) -> tuple[bool, str]:
        return first_problem(
            lambda: package_problem("liger_kernel", "liger-kernel", MINIMUM_VERSION),
            # The functions mega calls; importing them imports triton.
            lambda: package_problem("liger_kernel.transformers.functional", "liger-kernel", None,
                                    f"pip install -c constraints.txt 'liger-kernel >= {MINIMUM_VERSION}' triton"),
            lambda: self.gpu.problem(MINIMUM_CAPABILITY),
        )

    def component(self, kind: str):
        # optional dependency: the kernel library may be absent; the backend reports it
        from mega_liger import kernels

        return {"norm": kernels.norm, "rotary": kernels.rotary, "activation": kernels.activation,
                "linear_loss": kernels.LinearCrossEntropy()}[kind]


BACKEND = LigerBackend()
