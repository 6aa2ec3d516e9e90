"""The ``gpt`` family: GPT-2/GPT-3 (presets and family in ``family``, Hugging Face GPT-2 mapping in ``hf_gpt2``)."""
