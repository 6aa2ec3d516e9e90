"""The ``mega`` command line."""
