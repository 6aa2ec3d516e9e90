"""Test support for training runs (for the tests of mega-train, its plugins and the repository):
runs on gloo ranks of :mod:`mega.testing` worlds, and a check of `mega plan` against a real run."""
