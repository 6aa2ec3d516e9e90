"""mega-inference: Generation engine and REST server for mega."""
