"""The ``t5`` family: encoder-decoder transformers (T5 v1.0, T5 v1.1 / Flan-T5)."""
