"""mega-data: Tokenizers, indexed datasets, preprocessing and samplers for mega."""
