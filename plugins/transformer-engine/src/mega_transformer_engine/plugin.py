"""What mega-transformer-engine registers, by import path: listing plugins imports nothing heavy."""

from mega.core.plugins import hookimpl


@hookimpl
def register_kernel_backends(register):
    register("transformer-engine", "mega_transformer_engine.backend:BACKEND",
             "Transformer Engine LayerNormLinear, LayerNormMLP, Linear, LayerNorm/RMSNorm, DotProductAttention; FP8")


@hookimpl
def register_callbacks(register):
    register("fp8-autocast", "mega_transformer_engine.fp8:fp8_autocast_callback",
             "every forward in te.fp8_autocast with the recipe of --fp8-format/--fp8-amax-*/--fp8-margin")
