"""The ``gpt-oss`` family: OpenAI's gpt-oss (config in ``config``, layers in ``attention`` and
``experts``, the stage model in ``model``, presets in ``family``, Hugging Face mapping in
``hf_gpt_oss``)."""
