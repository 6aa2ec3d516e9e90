"""Tiny random Hugging Face models (GPT-2 and LLaMA; MHA and GQA; tied and untied), a tokenizer,
and the helpers the conversion tests share.

Test modules (and the ranks a multi-rank test starts) import this file by putting the tests'
directory on ``sys.path``: pytest's importlib mode does not.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Models are built from configs and tokenizers trained here; nothing may be downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

VOCAB, BATCH, SEQ = 300, 2, 16
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# variant -> (model class name, config keywords); rope settings in the keys every transformers reads.
VARIANTS = {
    "gpt2-tied": ("GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=32)),
    "gpt2-untied": ("GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                            tie_word_embeddings=False, activation_function="gelu")),
    "llama-mha-untied": ("LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=16384, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "llama-gqa-tied-bias": ("LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
}
TEXT = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs",
        "how vexingly quick daft zebras jump", "sphinx of black quartz, judge my vow"]


def make_hf_model(variant: str):
    import transformers

    class_name, settings = VARIANTS[variant]
    config_class = transformers.GPT2Config if class_name == "GPT2LMHeadModel" else transformers.LlamaConfig
    dropouts = ({"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if class_name == "GPT2LMHeadModel" else {})
    config = config_class(vocab_size=VOCAB, initializer_range=0.1, **dropouts, **settings)
    torch.manual_seed(sum(map(ord, variant)))
    model = getattr(transformers, class_name)(config).eval()
    with torch.no_grad():  # Hugging Face starts biases at 0 and norms at 1: make every value count
        for name, param in model.named_parameters():
            if name.endswith("bias") or param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def make_tokenizer():
    """A small byte-level BPE tokenizer (a ``tokenizers.Tokenizer``) with ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TEXT * 4, trainer)
    return tokenizer


def save_hf_model(model, directory: Path) -> Path:
    import transformers

    model.save_pretrained(directory)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=make_tokenizer(), eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return directory


def input_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_logits(directory: Path, ids: torch.Tensor, with_loss: bool = False):
    """transformers' logits of ``ids`` (and, ``with_loss``, its next-token loss over them)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        output = model(ids, labels=ids if with_loss else None)
    return (output.logits, output.loss) if with_loss else output.logits


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's safetensors files, read by the safetensors library."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def generation_engine(mega_dir: Path):
    """The one-process :class:`GenerationEngine` of a mega checkpoint (its model on the CPU)."""
    from mega.ckpt_convert import open_checkpoint
    from mega.core.build import build_stage
    from mega.core.checkpoint import load_model_weights
    from mega.core.plugins import get_plugins
    from mega.inference.engine import GenerationEngine

    with open_checkpoint(str(mega_dir)) as source:
        family, config = get_plugins().models.get(source.family), source.config
    model = build_stage(family, config, init=False, training=False)
    load_model_weights(str(mega_dir), [model.eval()])
    return GenerationEngine(model, vocab_size=config.vocab_size, max_positions=config.max_position_embeddings)


def tensor_parallel_greedy(mega_dir: str, prompts: list[list[int]], new_tokens: int):
    """On a rank of a world: the greedy continuations of ``prompts`` served at tp2 by the tensor
    group's leader (None on the follower, which runs the leader's batches)."""
    from mega.ckpt_convert import open_checkpoint
    from mega.core.build import build_stage
    from mega.core.checkpoint import load_model_weights
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.core.plugins import get_plugins
    from mega.inference.engine import GenerationEngine, GenerationRequest
    from mega.inference.engine.tp_serving import lead, receive

    groups = ParallelGroups(ParallelConfig(tp=2))
    with open_checkpoint(str(mega_dir)) as source:
        family, config = get_plugins().models.get(source.family), source.config
    model = build_stage(family, config, groups=groups, init=False, training=False)
    load_model_weights(str(mega_dir), [model.eval()], groups)
    engine = GenerationEngine(model, vocab_size=config.vocab_size, max_positions=config.max_position_embeddings,
                              tp_group=groups.tp)
    if groups.tp.rank != 0:  # every rank runs the one loop to completion on the leader's batches
        while (batch := receive(groups.tp)) is not None:
            engine.generate(batch)
        return None
    requests = [GenerationRequest(prompt, new_tokens) for prompt in prompts]
    lead(requests, groups.tp)
    results = engine.generate(requests)
    lead(None, groups.tp)
    return [result.tokens for result in results]


def greedy_as_transformers(hf_model, engine, prompts: list[list[int]], new_tokens: int, what: str) -> None:
    """The engine's greedy tokens for all ``prompts`` at once are transformers' for each alone."""
    from mega.inference.engine import GenerationRequest

    results = engine.generate([GenerationRequest(prompt, new_tokens) for prompt in prompts])
    for prompt, result in zip(prompts, results, strict=True):
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0].tolist()
        assert result.tokens == expected, what


def tiny_random_model(class_name: str, config_name: str, settings: dict, seed_name: str):
    """transformers' ``class_name`` built from ``config_name(**settings)``, seeded by ``seed_name``,
    its norms and biases moved off their 1 and 0 so that every value counts."""
    import transformers

    config = getattr(transformers, config_name)(**settings)
    torch.manual_seed(sum(map(ord, seed_name)))
    model = getattr(transformers, class_name)(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model


TEXT_PROMPTS = ["the quick brown fox jumps over", "pack my box", "sphinx of black quartz, judge my vow and"]


def mega_generate_records(mega_dir: Path, prompts: list[str], new_tokens: int, capsys) -> list[dict]:
    """``mega generate --greedy --json`` on ``mega_dir``, the prompts in one run: one record per
    prompt, in order (the command's own output, read from ``capsys``)."""
    import json

    from mega.inference.cli.generate import main as generate_main

    args = ["--load", str(mega_dir), "--max-tokens", str(new_tokens), "--greedy", "--json", "--device", "cpu"]
    assert generate_main(args + [arg for prompt in prompts for arg in ("--prompt", prompt)]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [record["prompt"] for record in records] == prompts
    return records
