"""Tokenizer files of a Hugging Face directory <-> mega's ``TokenizerSpec`` and its files.

Reading, the directory's files tell the mega tokenizer type: ``tokenizer.json`` ->
``HuggingFaceTokenizer``, ``vocab.json`` + ``merges.txt`` -> ``GPT2BPETokenizer``,
``tokenizer.model`` -> ``Llama2Tokenizer`` (SentencePiece). Writing, the spec's files get the
names ``AutoTokenizer`` looks for, the extra files (``tokenizer_config.json``...) are copied as
they are, and a minimal ``tokenizer_config.json`` names the tokenizer class when none came along.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mega.core.plugins import get_plugins
from mega.core.tokenizer import TokenizerOptions, TokenizerSpec

# Files that describe tokens beside the vocabulary itself; they travel with the model unchanged.
EXTRA_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "generation_config.json",
               "chat_template.jinja")
# mega tokenizer type -> (its file options under the names transformers reads, tokenizer class)
HF_LAYOUTS = {
    "HuggingFaceTokenizer": ({"tokenizer_model": "tokenizer.json"}, "PreTrainedTokenizerFast"),
    "GPT2BPETokenizer": ({"vocab_file": "vocab.json", "merge_file": "merges.txt"}, "GPT2Tokenizer"),
    "Llama2Tokenizer": ({"tokenizer_model": "tokenizer.model"}, "LlamaTokenizer"),
    "GPTSentencePieceTokenizer": ({"tokenizer_model": "tokenizer.model"}, "LlamaTokenizer"),
}


def read_hf_tokenizer(directory: Path) -> tuple[TokenizerSpec | None, dict[str, Path]]:
    """The spec (absolute paths) of a Hugging Face directory's tokenizer, and its extra files."""
    directory = directory.resolve()
    extras = {name: directory / name for name in EXTRA_FILES if (directory / name).is_file()}
    for tokenizer_type in ("HuggingFaceTokenizer", "GPT2BPETokenizer", "Llama2Tokenizer"):
        files, _ = HF_LAYOUTS[tokenizer_type]
        if all((directory / name).is_file() for name in files.values()):
            options = {option: str(directory / name) for option, name in files.items()}
            return TokenizerSpec(tokenizer_type, TokenizerOptions(**options)), extras
    return None, extras


def write_hf_tokenizer(spec: TokenizerSpec | None, extras: dict[str, Path], directory: Path) -> str | None:
    """Lay the tokenizer out in ``directory`` for ``AutoTokenizer``; a warning when it cannot be."""
    for name, path in extras.items():
        shutil.copyfile(path, directory / name)
    if spec is None:
        return "the source records no tokenizer: the output has no tokenizer files"
    if spec.type not in HF_LAYOUTS:
        return (f"tokenizer type {spec.type} has no transformers equivalent: the output has no tokenizer files "
                f"(AutoTokenizer will not load it)")
    files, tokenizer_class = HF_LAYOUTS[spec.type]
    for option, name in files.items():
        source = getattr(spec.options, option)
        if not source or not Path(source).is_file():
            return f"tokenizer file {option}={source!r} is missing: the output has no tokenizer"
        shutil.copyfile(source, directory / name)
    config_path = directory / "tokenizer_config.json"
    if "tokenizer_config.json" in extras:
        # Copied as it is, unless it names no end of text: then the tokenizer's own is added.
        try:
            config = json.loads(config_path.read_text())
        except ValueError:  # not ours to repair
            return None
        if isinstance(config, dict) and "eos_token" not in config and spec.type == "HuggingFaceTokenizer":
            eos = _special_tokens(spec).get("eos_token")
            if eos is not None:
                config_path.write_text(json.dumps({**config, "eos_token": eos}, indent=2) + "\n")
        return None
    config = {"tokenizer_class": tokenizer_class}
    if spec.type == "GPT2BPETokenizer":  # GPT-2's one special token is all three
        config.update(dict.fromkeys(("bos_token", "eos_token", "unk_token"), "<|endoftext|>"))
    elif spec.type == "HuggingFaceTokenizer":  # a bare tokenizer.json: declare what the tokenizer uses
        config.update(_special_tokens(spec))
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return None


def _special_tokens(spec: TokenizerSpec) -> dict[str, str]:
    """eos/bos/pad token strings of the tokenizer ``spec`` builds: a bare tokenizer.json names
    none, and clients (lm-evaluation-harness) need the end of text."""
    try:
        tokenizer = spec.build(get_plugins())
    except Exception:  # no tokenizer plugin here: the files are copied as they are
        return {}
    tokens = {}
    for key, token_id in (("eos_token", tokenizer.eod), ("bos_token", tokenizer.bos), ("pad_token", tokenizer.pad)):
        if token_id is not None:
            tokens[key] = tokenizer.detokenize([token_id])
    return tokens
