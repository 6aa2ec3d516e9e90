"""LoRA: the adapters (``adapters``), their training pass and flags (``training``), merging at load (``load``)."""
