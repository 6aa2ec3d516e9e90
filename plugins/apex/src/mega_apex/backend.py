"""apex's kernels as mega backends, and whether they can run here.

apex's fused kernels are CUDA extensions built with apex itself (``--cpp_ext --cuda_ext``);
a pip install without them imports but has no kernels, so each check asks for the extension
module the component calls: ``fused_layer_norm_cuda`` (norms), ``amp_C`` (FusedAdam),
``scaled_upper_triang_masked_softmax_cuda`` and ``scaled_masked_softmax_cuda`` (softmax).
"""

from __future__ import annotations

from mega.core.kernel_requirements import GPU, CudaGPU, first_problem, package_problem

MINIMUM_CAPABILITY = (7, 0)
BUILD = ("pip install -c constraints.txt -v --no-build-isolation --config-settings '--build-option=--cpp_ext' "
         "--config-settings '--build-option=--cuda_ext' git+https://github.com/NVIDIA/apex")


def _needs(module: str, what: str):
    return lambda: package_problem(module, what, None, BUILD)


class _ApexPart:
    """What every apex part shares: apex itself, its CUDA extensions, a GPU."""

    extensions: tuple[str, ...] = ()

    def __init__(self, gpu: GPU | None = None):
        # The GPU probe; tests replace it (there is no GPU in CI) and nothing else does.
        self.gpu = gpu or CudaGPU()

    def is_available(self) -> tuple[bool, str]:
        return first_problem(_needs("apex", "apex"),
                             *(_needs(ext, f"apex built with --cuda_ext (its {ext} extension)") for ext in self.extensions),
                             lambda: self.gpu.problem(MINIMUM_CAPABILITY))


class ApexNorms(_ApexPart):
    name = "apex"
    kinds = frozenset({"norm"})
    extensions = ("apex.normalization.fused_layer_norm", "fused_layer_norm_cuda")

    def component(self, kind: str):
        # optional dependency: the kernel library may be absent; the backend reports it
        from mega_apex.kernels import ApexNorm

        return {"norm": ApexNorm}[kind]


class ApexSoftmax(_ApexPart):
    name = "apex-softmax"
    kinds = frozenset({"attention"})
    extensions = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda")

    def component(self, kind: str):
        # optional dependency, as above
        from mega_apex.kernels import fused_softmax_attention

        return {"attention": fused_softmax_attention}[kind]


class FusedAdamFactory(_ApexPart):
    """``--optimizer apex-adam``: ``factory(param_groups, config)``, and ``is_available`` so the
    run is refused before any work where apex cannot serve."""

    extensions = ("apex.optimizers", "amp_C")

    def __call__(self, param_groups: list[dict], config):
        available, missing = self.is_available()
        if not available:
            raise RuntimeError(f"--optimizer apex-adam needs {missing}")
        # optional dependency, as above
        from mega_apex.optimizer import fused_adam

        return fused_adam(param_groups, config)


NORMS, SOFTMAX, FUSED_ADAM = ApexNorms(), ApexSoftmax(), FusedAdamFactory()
