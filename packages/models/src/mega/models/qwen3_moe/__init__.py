"""The ``qwen3-moe`` family: Qwen3-MoE (presets and family in ``family``, Hugging Face mapping in ``hf_qwen3_moe``)."""
