"""What mega-torchao registers, by import path: listing plugins imports neither torch nor torchao."""

from mega.core.plugins import hookimpl


@hookimpl
def register_kernel_backends(register):
    register("torchao", "mega_torchao.backend:BACKEND",
             "FP8 training through torchao.float8: --fp8-recipe tensorwise or rowwise (current scaling)")


@hookimpl
def register_setup_passes(register):
    register("fp8-torchao", "mega_torchao.fp8:fp8_pass",
             "precision: the FP8 layers of apply_fp8 in every model chunk when --fp8-recipe is tensorwise or rowwise")
    # The name mega-inference asks for (mega.inference.quantization): one plugin provides it.
    register("quantization", "mega_torchao.quantization:quantization_pass",
             "precision (inference): weight-only int8, fp8 or int4 linear layers, mega generate|serve|eval "
             "--quantization")
