"""The one error conversion raises for input it cannot convert."""


from mega.core.checkpoint.metadata import CheckpointError


class ConversionError(CheckpointError):
    """Missing or inconsistent files, a config that does not match the tensors, an unsupported
    architecture...: the message names the file or field and says what is wrong. A kind of
    CheckpointError, so code that loads checkpoints of any format catches one exception."""
