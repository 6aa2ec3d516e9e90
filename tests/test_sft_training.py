"""`mega train --sft` on `mega preprocess --chat` data: packed rows train exactly as one conversation
per row (per-token loss, fp32); packed training, without and with LoRA adapters, at tp2 + sequence
parallel, pp2 and dp2 with the distributed optimizer computes what one process computes; a LoRA run
starts from a base checkpoint, saves its adapters alone and resumes from them on the base."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from mega.core.cli.main import main as mega
from mega.core.testing.training_runs import assert_losses_close, train_each, train_losses

SEQ = 64
VOCAB = 90
# A word-level vocabulary of numbers and two special tokens: real chat data at a tiny vocabulary.
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }} "
            "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|end|>{% endgeneration %}"
            "{% else %}{{ m.content }}<|end|>{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("sft")
    vocab = {str(i): i for i in range(VOCAB - 5)} | {"user": VOCAB - 5, "assistant": VOCAB - 4, "[UNK]": VOCAB - 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|start|>", "<|end|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>", "chat_template": TEMPLATE}))
    rng = random.Random(0)

    def words(n):
        return " ".join(str(rng.randrange(0, VOCAB - 5)) for _ in range(n))

    rows = [{"messages": [{"role": "user", "content": words(rng.randrange(1, 8))},
                          {"role": "assistant", "content": words(rng.randrange(1, 10))}]} for _ in range(16)]
    (directory / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert mega(["preprocess", "--chat", "--input", str(directory / "chat.jsonl"), "--output-prefix",
                 str(directory / "chat"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                 str(directory), "--workers", "1"]) == 0
    return str(directory / "chat_messages_document"), str(directory)


def flags(data, rows, *extra):
    prefix, tokenizer = data
    return ["--sft", "--data-path", prefix, "--split", "100,0,0", "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", tokenizer, "--model-family", "llama", "--model-preset", "tiny", "--num-layers", "2",
            "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
            "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--make-vocab-size-divisible-by", "32",
            "--micro-batch-size", "2", "--global-batch-size", str(rows), "--train-iters", "2", "--lr", "1e-3",
            "--eval-iters", "0", "--log-interval", "100", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--seed", "3", "--calculate-per-token-loss", *extra]


LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2"]
LAYOUTS = {"tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
           "pp2": ["--pipeline-model-parallel-size", "2"],
           "dp2-distributed-optimizer": ["--use-distributed-optimizer", "--micro-batch-size", "1"]}


def test_packed_rows_train_as_one_conversation_per_row(chat_data, worlds):
    from mega.data.indexed_dataset import IndexedDataset
    from mega.data.packing import first_fit_decreasing

    lengths = IndexedDataset(chat_data[0]).sequence_lengths
    bins = len(first_fit_decreasing(lengths, SEQ)[1]) - 1
    assert bins < len(lengths) // 2, "the conversations should pack several to a row"
    assert bins % 2 == 0, "a step of whole epochs at dp2 needs an even number of rows"
    unpacked = train_losses(flags(chat_data, len(lengths), "--micro-batch-size", "8"))  # a step: one epoch
    packed = train_losses(flags(chat_data, bins, "--packed-sequences"))
    assert_losses_close(packed, unpacked, "packed vs one conversation per row")

    lora = train_losses(flags(chat_data, bins, "--packed-sequences", *LORA))
    assert lora[0] == packed[0] and lora[1] != packed[1], "a fresh adapter changes nothing; then it trains"
    # LoRA's frozen base still carries every activation gradient through the packed attention.
    results = worlds.run(2, train_each, [flags(chat_data, bins, "--packed-sequences", *extra, *LORA)
                                         for extra in LAYOUTS.values()])
    for index, layout in enumerate(LAYOUTS):
        assert_losses_close(results[0][index], lora, f"packed, LoRA, {layout}")


def test_context_parallel_with_packing_is_refused(chat_data):
    from mega.core.config import ConfigError
    from mega.core.training.run_config import derive
    from mega.core.training.run_parser import parse_run

    run, _ = parse_run(flags(chat_data, 2, "--packed-sequences", "--context-parallel-size", "2"))
    with pytest.raises(ConfigError, match="--packed-sequences does not run under --context-parallel-size 2"):
        derive(run, 2)
    assert np.isfinite(train_losses(flags(chat_data, 2))[0])  # unpacked, mean per micro-batch


def test_lora_starts_from_a_base_checkpoint_and_resumes(chat_data, tmp_path):
    import torch

    from mega.core.checkpoint.model_io import read_tensors, tensor_shapes

    base, lora = tmp_path / "base", tmp_path / "lora"
    base_losses = train_losses(flags(chat_data, 2, "--save", str(base)))
    first = train_losses(flags(chat_data, 2, *LORA, "--load", str(base), "--finetune", "--save", str(lora)))
    assert first[0] < base_losses[0]  # the base's trained weights were loaded (B = 0 adds nothing)
    assert sorted(tensor_shapes(lora)) == sorted(n for n in tensor_shapes(lora) if ".adapter." in n)  # alone
    assert len(tensor_shapes(lora)) == 16
    with pytest.raises(Exception, match="--lora-rank with --save but no --load"):
        train_losses(flags(chat_data, 2, *LORA, "--save", str(tmp_path / "nowhere")))
    with pytest.raises(Exception, match="holds LoRA adapters alone: give the base model with --load"):
        train_losses(flags(chat_data, 2, *LORA, "--load", str(lora)))
    resumed = train_losses(flags(chat_data, 2, *LORA, "--load", str(base), "--load-adapter", str(lora),
                                 "--train-iters", "3"))
    assert len(resumed) == 1  # iterations 3 of 3: it resumed at 2

    # (that merged weights compute the adapted model: packages/ckpt-convert/tests/test_hf_peft.py)
    assert mega(["lora", "merge", "--load", str(base), "--load-adapter", str(lora), "--save", str(tmp_path / "merged")]) == 0
    assert not any(".adapter." in name for name in tensor_shapes(tmp_path / "merged"))
    assert mega(["lora", "export-peft", "--load", str(lora), "--output", str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    # The PEFT adapter folded into the (frozen, unchanged) base is the merged checkpoint.
    assert mega(["lora", "import-peft", "--load", str(base), "--adapter", str(tmp_path / "peft"),
                 "--save", str(tmp_path / "imported")]) == 0
    names = list(tensor_shapes(tmp_path / "merged"))
    imported, merged_weights = read_tensors(tmp_path / "imported", names), read_tensors(tmp_path / "merged", names)
    for name in names:
        torch.testing.assert_close(imported[name], merged_weights[name], rtol=1e-5, atol=1e-6)
