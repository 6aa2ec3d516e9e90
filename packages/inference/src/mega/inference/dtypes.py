"""The dtypes a model loads in, by the names ``--dtype`` takes; torch-free, so ``--help`` stays light."""

DTYPE_NAMES = ("bfloat16", "float16", "float32")
