"""The ``bert`` family: config, stage model, presets and family, Hugging Face mapping."""
