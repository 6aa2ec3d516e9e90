"""`mega train --sft` on `mega preprocess --chat` data: packed rows train exactly as one conversation
per row (per-token loss, fp32); packed training, without and with LoRA adapters, at tp2 + sequence
parallel, pp2 and dp2 with the distributed optimizer computes what one process computes; a LoRA run
starts from a base checkpoint, saves its adapters alone and resumes from them on the base."""

from __future__ import annotations

import contextlib
import io
import json
import random

import pytest

from mega.core.cli.main import main as mega
from mega.train.testing.training_runs import assert_losses_close, train_each, train_losses

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


@pytest.fixture(scope="module")
def unpacked(chat_data) -> list[float]:
    """LLaMA's losses with one conversation per row in one process, a step one epoch (per-token loss)."""
    from mega.data.indexed_dataset import IndexedDataset

    rows = len(IndexedDataset(chat_data[0]).sequence_lengths)
    return train_losses(flags(chat_data, rows, "--micro-batch-size", "8"))


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
           # the frozen base's weights have no W: the adapters' alone are deferred
           "pp2-zb-h1": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"],
           "dp2-distributed-optimizer": ["--use-distributed-optimizer", "--micro-batch-size", "1"]}


def test_packed_rows_train_as_one_conversation_per_row(chat_data, worlds, unpacked):
    from mega.data.indexed_dataset import IndexedDataset
    from mega.data.packing import first_fit_decreasing

    lengths = IndexedDataset(chat_data[0]).sequence_lengths
    bins = len(first_fit_decreasing(lengths, SEQ)[1]) - 1
    assert bins < len(lengths) // 2, "the conversations should pack several to a row"
    assert bins % 2 == 0, "a step of whole epochs at dp2 needs an even number of rows"
    packed = train_losses(flags(chat_data, bins, "--packed-sequences"))
    assert_losses_close(packed, unpacked, "packed vs one conversation per row")

    lora = train_losses(flags(chat_data, bins, "--packed-sequences", *LORA))
    assert lora[0] == packed[0] and lora[1] != packed[1], "a fresh adapter changes nothing; then it trains"
    # LoRA's frozen base still carries every activation gradient through the packed attention.
    results = worlds.run(2, train_each, [flags(chat_data, bins, "--packed-sequences", *extra, *LORA)
                                         for extra in LAYOUTS.values()])
    for index, layout in enumerate(LAYOUTS):
        assert_losses_close(results[0][index], lora, f"packed, LoRA, {layout}")


CP_LAYOUTS = {f"cp2-{comm}": ["--micro-batch-size", "1", "--context-parallel-size", "2", "--cp-comm-type", comm]
              for comm in ("p2p", "all_gather", "a2a")}


def test_packed_rows_under_context_parallelism(chat_data, worlds, unpacked, monkeypatch):
    """cp2 pads each packed conversation to a multiple of 4 and splits it per document. With
    --calculate-per-token-loss every comm type trains as one conversation per row in one process
    (LLaMA; GPT on the ring); with the mean per micro-batch, as one process on the same padded rows. (Each comm type's attention over packed rows, forward and backward:
    packages/models/tests/test_context_attention.py.)"""
    from mega.data.indexed_dataset import IndexedDataset
    from mega.data.packing import first_fit_decreasing
    from mega.train import data_setup

    lengths = IndexedDataset(chat_data[0]).sequence_lengths
    bins = len(first_fit_decreasing(-(-lengths // 4) * 4, SEQ)[1]) - 1
    assert bins < len(lengths) // 2, "the conversations should pack several to a row"
    gpt = ["--model-family", "gpt", "--num-query-groups", "4"]
    per_token = {name: flags(chat_data, bins, "--packed-sequences", *extra) for name, extra in CP_LAYOUTS.items()}
    per_token["gpt-cp2-p2p"] = flags(chat_data, bins, "--packed-sequences", *gpt, *CP_LAYOUTS["cp2-p2p"])
    per_micro_batch = {name: [flag for flag in per_token[name] if flag != "--calculate-per-token-loss"]
                       for name in CP_LAYOUTS}
    results = worlds.run(2, train_each, list(per_token.values()) + list(per_micro_batch.values()))

    alone = {"llama": unpacked, "gpt": train_losses(flags(chat_data, len(lengths), "--micro-batch-size", "8", *gpt))}
    for index, name in enumerate(per_token):
        assert_losses_close(results[0][index], alone["gpt" if name.startswith("gpt") else "llama"],
                            f"{name}, per-token loss, vs one conversation per row")
    monkeypatch.setattr(data_setup, "packed_document_multiple", lambda run: 4)  # cp2's padding, in one process
    padded = train_losses(per_micro_batch["cp2-p2p"][:-4])
    for index, name in enumerate(per_micro_batch, start=len(per_token)):
        assert_losses_close(results[0][index], padded, f"{name}, mean per micro-batch, vs one process")


EOD_DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


def test_gpt_data_documents_under_context_parallelism(chat_data, worlds):
    """Megatron's --reset-attention-mask on GPT data (the chat corpus read as plain token data: every
    message ends at an end-of-document token, documents of any length, several per row, crossing the
    chunks): at cp2 the rows split the ordinary way and each comm type masks by document, training
    as one process does (GPT with --calculate-per-token-loss on every comm type and with the mean per
    micro-batch on the ring; LLaMA on the ring)."""
    gpt = ["--model-family", "gpt", "--num-query-groups", "4"]

    def run_flags(*extra):
        return flags(chat_data, 4, *EOD_DOCUMENTS, *extra)[1:]  # no --sft: GPT data

    alone = {"gpt": run_flags(*gpt), "llama": run_flags(),
             "gpt-mean": [flag for flag in run_flags(*gpt, "--micro-batch-size", "1")  # cp2's micro-batches
                          if flag != "--calculate-per-token-loss"]}
    cp2 = {f"gpt-{name}": alone["gpt"] + extra for name, extra in CP_LAYOUTS.items()}
    cp2["llama-cp2-p2p"] = alone["llama"] + CP_LAYOUTS["cp2-p2p"]
    cp2["gpt-mean-cp2-p2p"] = alone["gpt-mean"] + CP_LAYOUTS["cp2-p2p"][2:]
    results = worlds.run(2, train_each, list(cp2.values()))
    references = {name: train_losses(run) for name, run in alone.items()}
    for index, name in enumerate(cp2):
        assert_losses_close(results[0][index], references[name.rsplit("-cp2-", 1)[0]], f"{name} vs one process")


def test_lora_starts_from_a_base_checkpoint_and_resumes(chat_data, tmp_path, worlds):
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
    # `mega lora export-peft` and `mega convert --to hf-peft` spell one export; import likewise.
    peft_dir = tmp_path / "peft"
    assert mega(["lora", "export-peft", "--load", str(lora), "--output", str(tmp_path / "peft-lora")]) == 0
    assert mega(["convert", "--to", "hf-peft", "--input", str(lora), "--output", str(peft_dir)]) == 0
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        assert (peft_dir / file).read_bytes() == (tmp_path / "peft-lora" / file).read_bytes()
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    # The PEFT adapter folded into the (frozen, unchanged) base is the merged checkpoint.
    assert mega(["lora", "import-peft", "--load", str(base), "--adapter", str(peft_dir),
                 "--save", str(tmp_path / "imported")]) == 0
    assert mega(["convert", "--from", "hf-peft", "--to", "mega", "--input", str(peft_dir), "--base", str(base),
                 "--output", str(tmp_path / "converted")]) == 0
    names = list(tensor_shapes(tmp_path / "merged"))
    merged_weights = read_tensors(tmp_path / "merged", names)
    for folded in (read_tensors(tmp_path / "imported", names), read_tensors(tmp_path / "converted", names)):
        for name in names:
            torch.testing.assert_close(folded[name], merged_weights[name], rtol=1e-5, atol=1e-6)
    check_adapter_at_load(tmp_path, base, lora, peft_dir)
    # At tp2 every rank's shards of the base with the adapters merged at load are the merged checkpoint's.
    for rank in worlds.run(2, tensor_parallel_shards, str(base), str(lora), str(tmp_path / "merged")):
        assert rank["adapted"].keys() == rank["merged"].keys() and len(rank["merged"]) > 10
        for name, shard in rank["merged"].items():
            torch.testing.assert_close(rank["adapted"][name], shard, rtol=0, atol=1e-6, msg=name)


def tensor_parallel_shards(base, lora, merged):
    """This rank's parameter shards (CPU, tp = the world) of ``base`` + ``lora`` merged at load and of
    the ``merged`` checkpoint."""
    from types import SimpleNamespace

    import torch

    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.inference.loader import load_from_args

    groups = ParallelGroups(ParallelConfig(tp=torch.distributed.get_world_size()))
    result = {}
    for key, load, adapter in (("adapted", base, lora), ("merged", merged, None)):
        args = SimpleNamespace(load=load, adapter=adapter, tokenizer_type=None, device="cpu", dtype="float32")
        model = load_from_args(args, groups).model
        result[key] = {name: param.detach().clone() for name, param in model.named_parameters()}
    return result


def check_adapter_at_load(tmp_path, base, lora, peft_dir):
    """`--adapter`: the base with the adapters merged as it loads is the merged checkpoint (same
    logits, same generated tokens), which PEFT's model of the `--to hf-peft` export computes too;
    a directory of no adapters, a PEFT directory, adapters of another model are errors naming it."""
    import dataclasses
    from types import SimpleNamespace

    import peft
    import torch
    import transformers

    from mega.core.checkpoint import checkpoint_and_metadata, read_tensors, tensor_shapes, write_checkpoint
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.inference.loader import LoadError, load_from_args

    def load(path, adapter=None):
        args = SimpleNamespace(load=str(path), adapter=adapter and str(adapter), tokenizer_type=None, device="cpu",
                               dtype="float32")
        return load_from_args(args, ParallelGroups(ParallelConfig()))

    ids = torch.tensor([[3, 14, 15, 92 % VOCAB, 65, 35, 89 % VOCAB, 79]])
    with torch.no_grad():
        adapted = load(base, lora).model(ids).transpose(0, 1)[..., :VOCAB]
        merged = load(tmp_path / "merged").model(ids).transpose(0, 1)[..., :VOCAB]
        plain = load(base).model(ids).transpose(0, 1)[..., :VOCAB]
    torch.testing.assert_close(adapted, merged, rtol=0, atol=1e-6)
    assert not torch.allclose(adapted, plain, atol=1e-4), "the trained adapter changes the model"

    assert mega(["convert", "--to", "hf", "--input", str(base), "--output", str(tmp_path / "hf")]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    with torch.no_grad():
        reference = peft.PeftModel.from_pretrained(hf_model, str(peft_dir)).eval()(ids).logits[..., :VOCAB]
    torch.testing.assert_close(adapted, reference, rtol=1e-4, atol=1e-4)

    prompt = ["--prompt", "<|start|>user 1 2 3<|end|><|start|>assistant", "--max-tokens", "6", "--greedy", "--device", "cpu"]
    outputs = []
    for load_flags in (["--load", str(base), "--adapter", str(lora)], ["--load", str(tmp_path / "merged")]):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert mega(["generate", *load_flags, *prompt]) == 0
        outputs.append(out.getvalue())
    assert outputs[0] == outputs[1] and outputs[0].strip()

    with pytest.raises(LoadError, match="holds no LoRA adapters"):
        load(base, base)
    with pytest.raises(LoadError, match="is a PEFT adapter directory: fold it"):
        load(base, peft_dir)
    directory, metadata = checkpoint_and_metadata(lora)
    adapters = read_tensors(lora, list(tensor_shapes(lora)))
    other = {name.replace("layers.1.", "layers.7."): tensor for name, tensor in adapters.items()}
    write_checkpoint(tmp_path / "other-layers", dataclasses.replace(metadata, files={}, checksums={}), other)
    with pytest.raises(LoadError, match="adapts decoder.layers.7.*which this base model does not have"):
        load(base, tmp_path / "other-layers")
    write_checkpoint(tmp_path / "other-family", dataclasses.replace(metadata, model_family="gpt", files={},
                                                                    checksums={}), adapters)
    with pytest.raises(LoadError, match="trained on a gpt model, this base is llama"):
        load(base, tmp_path / "other-family")
