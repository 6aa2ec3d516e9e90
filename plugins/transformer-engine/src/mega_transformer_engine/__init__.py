"""Transformer Engine kernels and FP8 training for mega (``--kernels transformer-engine``,
``--transformer-impl transformer_engine``, ``--fp8-format``). See the README."""
