"""The one error conversion raises for input it cannot convert."""


class ConversionError(Exception):
    """Missing or inconsistent files, a config that does not match the tensors, an unsupported
    architecture...: the message names the file or field and says what is wrong."""
