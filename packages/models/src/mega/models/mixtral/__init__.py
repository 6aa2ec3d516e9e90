"""The ``mixtral`` family: Mixtral (presets and family in ``family``, Hugging Face mapping in ``hf_mixtral``; its stage model is :mod:`mega.models.mixtral.model`)."""
