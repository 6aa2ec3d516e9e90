"""mega's flash-attention kernel backend: see README.md (``--attention-backend flash-attn``,
``--block-attention-backend flash-attn``, ``--use-flash-attn``, ``--kernels flash-attn``)."""
