"""The ``deepseek-v3`` family: config, stage model, multi-token prediction, presets and family, Hugging Face mapping."""
