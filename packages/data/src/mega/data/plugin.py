"""What mega-data registers with mega, through the entry-point group ``mega``.

Everything is registered by import path, so ``mega --help`` and ``mega plugins`` import none of
the tokenizer libraries, numpy pipelines or dataset code.
"""

from mega.core.plugins import Command, hookimpl


@hookimpl
def register_tokenizers(register):
    # start-up cost: plugin registration imports the table when the hook runs, not at discovery
    from mega.data.tokenizers import TOKENIZER_TYPES

    for name, (factory, description) in TOKENIZER_TYPES.items():
        register(name, f"mega.data.tokenizers:{factory}", description)


@hookimpl
def register_datasets(register):
    register("gpt", "mega.data.training_data:gpt_datasets", "Megatron GPTDataset splits and blends of .bin/.idx data")
    register("mock", "mega.data.training_data:mock_datasets", "synthetic GPT samples (Megatron's mock data)")
    register("bert", "mega.data.training_data:bert_datasets",
             "megatron-core's BERT masked-LM sentence pairs over sentence-split .bin/.idx data")
    register("bert-mock", "mega.data.training_data:bert_mock_datasets", "BERT samples over synthetic sentences")
    register("t5", "mega.data.training_data:t5_datasets",
             "megatron-core's T5 span-corruption samples over sentence-split .bin/.idx data")
    register("t5-mock", "mega.data.training_data:t5_mock_datasets", "T5 samples over synthetic sentences")
    register("sft", "mega.data.sft_dataset:sft_datasets",
             "chat conversations from `mega preprocess --chat`, assistant tokens in the loss, packed with "
             "--packed-sequences (mega train --sft)")
    register("pydoc-topics", "mega.data.embedded_corpus:pydoc_topics_datasets",
             "the text of Python's pydoc topics with a BPE tokenizer trained on it (the embedded default)")
    register("pydoc-chat", "mega.data.embedded_chat:pydoc_chat_datasets",
             "questions on the pydoc topics answered by their opening sentences (the demo's LoRA step, --sft)")


@hookimpl
def register_commands(register):
    register(
        "preprocess",
        Command(help="tokenize JSONL/Parquet/CSV/text into Megatron .bin/.idx datasets", main="mega.data.preprocess_cli:main"),
    )
    register(
        "merge-datasets",
        Command(help="concatenate .bin/.idx datasets into one", main="mega.data.merge_cli:main"),
    )
