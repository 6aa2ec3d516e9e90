"""mega's NVIDIA apex plugin: see README.md (``--kernels apex``, ``--attention-backend apex-softmax``,
``--optimizer apex-adam``)."""
