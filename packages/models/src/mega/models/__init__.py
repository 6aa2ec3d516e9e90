"""mega-models: Transformer blocks and model families for mega."""
