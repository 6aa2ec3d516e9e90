"""mega's Liger kernel backend: see README.md (``--kernels liger``)."""
