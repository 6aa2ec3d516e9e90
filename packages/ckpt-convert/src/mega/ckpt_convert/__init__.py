"""mega-ckpt-convert: Checkpoint conversion for mega."""
