"""The ``qwen3`` family: Qwen3 dense (presets and family in ``family``, Hugging Face mapping in ``hf_qwen3``)."""
