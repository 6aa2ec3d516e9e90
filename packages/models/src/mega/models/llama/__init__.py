"""The ``llama`` family: LLaMA-2/3 (presets and family in ``family``, Hugging Face mapping in ``hf_llama``)."""
