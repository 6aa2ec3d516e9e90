"""Registers the ``parallel-block`` family and the ``hand-norm`` kernel backend (by import path,
so listing plugins imports no torch)."""

from mega.core.plugins import hookimpl


@hookimpl
def register_models(register):
    register("parallel-block", "mega_parallel_block.family:FAMILY", "GPT-J style parallel attention+MLP blocks")


@hookimpl
def register_kernel_backends(register):
    register("hand-norm", "mega_parallel_block.norm:BACKEND", "norm: RMSNorm/LayerNorm written out by hand")
