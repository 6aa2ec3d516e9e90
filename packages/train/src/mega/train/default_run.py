"""`mega train` with no arguments: a small GPT trained on the CPU on text every Python has.

The corpus is the ``pydoc-topics`` dataset of mega-data (Python's own help topics, tokenized on
first use with a BPE tokenizer trained on them). The run is sized to finish in about two minutes
on two cores with the loss falling from about ln(vocabulary) to well under half of that. It is an
ordinary run: the same flags given to `mega train` do the same thing. The trained model is saved
to ``checkpoints/pydoc-gpt`` under the working directory, with its tokenizer, for `mega generate`.
"""

from __future__ import annotations

from mega.core.plugins import PluginError
from mega.core.plugins.install_hint import repository_package

# Where the default run leaves its model (relative to the working directory), for `mega generate`.
DEFAULT_SAVE_DIR = "checkpoints/pydoc-gpt"

# Where the demo's second step leaves its LoRA adapters (the base stays in DEFAULT_SAVE_DIR).
DEFAULT_LORA_DIR = "checkpoints/pydoc-gpt-lora"

# The demo GPT: the default run trains it, the LoRA step adapts it.
MODEL_FLAGS = [
    "--model-family", "gpt", "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "128", "--hidden-dropout", "0", "--attention-dropout", "0",
]

# One declaration of the default run, in the flags a user would type.
DEFAULT_ARGV = [
    "--dataset", "pydoc-topics", "--split", "95,5,0", *MODEL_FLAGS,
    "--micro-batch-size", "16", "--train-iters", "500",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "30", "--lr-decay-style", "cosine",
    "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--eval-interval", "250", "--eval-iters", "4", "--log-interval", "25", "--seed", "1234",
    "--save", DEFAULT_SAVE_DIR,
]


# The demo's second step (noxfile's demo session spells the same command): fine-tune the saved GPT
# with rank-16 LoRA adapters on questions about the same topics (the ``pydoc-chat`` dataset, packed,
# the assistant's answers alone in the loss), then `mega generate --adapter` answers one.
LORA_ARGV = [
    "--sft", "--dataset", "pydoc-chat", "--packed-sequences", "--split", "100,0,0", *MODEL_FLAGS,
    "--load", DEFAULT_SAVE_DIR, "--finetune", "--lora-rank", "16", "--lora-alpha", "32",
    "--micro-batch-size", "16", "--train-iters", "40", "--lr", "3e-3", "--lr-warmup-iters", "5",
    "--lr-decay-style", "cosine", "--calculate-per-token-loss", "--eval-iters", "0", "--log-interval", "10",
    "--seed", "1234", "--save", DEFAULT_LORA_DIR,
]


def missing_requirement(plugins) -> str | None:
    """Why the default run cannot start in this installation (mega-data is missing), or None."""
    try:
        plugins.datasets.entry("pydoc-topics")
    except PluginError as error:
        return f"the embedded default needs mega-data: {repository_package('mega-data', 'packages/data')}: {error}"
    return None


ANNOUNCEMENT = ("mega train: no arguments, so training the embedded default (a small GPT on Python's pydoc "
                "topics, on the CPU);\n  the same run is `mega train " + " ".join(DEFAULT_ARGV) + "`")
