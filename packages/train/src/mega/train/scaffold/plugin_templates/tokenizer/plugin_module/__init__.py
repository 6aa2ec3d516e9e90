"""plugin_name: one token per UTF-8 byte; 256 ends a document."""

from mega.core.plugins import hookimpl
from mega.core.tokenizer import TokenizerOptions


class ByteTokenizer:
    vocab_size, eod, pad, bos = 257, 256, None, None

    def __init__(self, options: TokenizerOptions):
        pass  # nothing to load: the vocabulary is the 256 byte values

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@hookimpl
def register_tokenizers(register):
    register("plugin_name", ByteTokenizer, "one token per UTF-8 byte")
