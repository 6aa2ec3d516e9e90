"""What mega-inference registers with mega, through the entry-point group ``mega``.

Commands are registered by import path, so ``mega --help`` imports neither torch nor FastAPI.
"""

from mega.core.plugins import Command, hookimpl


@hookimpl
def register_commands(register):
    register(
        "generate",
        Command(help="continue text prompts with a checkpoint (greedy or sampled) and print them",
                main="mega.inference.cli.generate:main"),
    )
    register(
        "serve",
        Command(help="REST text-generation server: Megatron's PUT /api and OpenAI-style /v1/completions",
                main="mega.inference.cli.serve:main"),
    )
    register(
        "eval",
        Command(help="Megatron's zero-shot tasks: wikitext-ppl (perplexity) and lambada (last-word accuracy)",
                main="mega.inference.cli.eval:main"),
    )
    register(
        "embed",
        Command(help="embed texts or token ids from a JSON-lines file with an encoder model (bert family)",
                main="mega.inference.cli.embed:main"),
    )
