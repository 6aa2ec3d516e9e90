"""The command-line entry points of mega-inference: ``mega generate``, ``serve``, ``embed``, ``eval``, and the flags they share to load a model (``load_arguments``)."""
