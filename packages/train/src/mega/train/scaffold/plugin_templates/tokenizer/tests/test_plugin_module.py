"""The installed tokenizer is found by its --tokenizer-type name and round-trips text."""

from mega.core.plugins import get_plugins
from mega.core.tokenizer import Tokenizer, TokenizerOptions


def test_the_tokenizer_round_trips():
    tokenizer = get_plugins().tokenizers.get("plugin_name")(TokenizerOptions())
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.tokenize("hé") == [104, 195, 169]
    assert tokenizer.detokenize(tokenizer.tokenize("héllo") + [tokenizer.eod]) == "héllo"
