"""Tiny random Hugging Face models (built offline) and the same weights as mega models.

Test modules (and the ranks a multi-rank test starts) import this file by putting the tests'
directory on ``sys.path``: pytest's importlib mode does not.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs; nothing is downloaded

VOCAB = 250  # pads to 256: the padded rows must never be chosen
POSITIONS = 64


def hf_tiny(kind: str):
    """A random ``transformers`` GPT-2 or LLaMA (grouped-query attention), in eval mode."""
    import torch
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=POSITIONS,
                                         initializer_range=0.1, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=POSITIONS,
                                      initializer_range=0.1, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return transformers.LlamaForCausalLM(config).eval()


def mega_from_hf(hf_model, family_name: str, groups=None):
    """The mega model computing what ``hf_model`` computes, tensor-parallel over ``groups.tp``."""
    return mega_from_hf_weights(hf_model.config.to_dict(), hf_model.state_dict(), family_name, groups)


def mega_from_hf_weights(hf_config: dict, hf_state: dict, family_name: str, groups=None):
    """:func:`mega_from_hf` from the Hugging Face config and weights: ranks of a multi-rank test
    get these, and need not import ``transformers`` (seconds per process)."""
    import torch

    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.core.parallel.layers import shard_of
    from mega.core.parallel.param_attrs import is_tensor_parallel
    from mega.core.plugins import get_plugins
    from mega.inference.loader import build_model
    from mega.models.hf_mapping import hf_to_mega

    family = get_plugins().models.get(family_name)
    config = family.hf_mapping.config_from_hf(hf_config)
    groups = groups or ParallelGroups(ParallelConfig())
    model = build_model(family, config, groups, torch.device("cpu"), torch.float32)
    full = hf_to_mega(family.hf_mapping, hf_state, config, groups.tp.size)
    with torch.no_grad():
        for name, param in model.named_parameters():
            weight = full[name]
            if is_tensor_parallel(param):
                weight = shard_of(weight, groups.tp, param.partition_dim, param.partition_chunks)
            param.copy_(weight)
    return model, config


BYTE_VOCAB = 257  # 256 byte tokens and <|endoftext|>
END_OF_TEXT = "<|endoftext|>"
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def hf_byte_level_directory(directory, positions: int = 128):
    """A Hugging Face directory any client can load: a tiny random GPT-2 and a byte-level BPE
    tokenizer without merges (each byte one token; ``<|endoftext|>`` 256 its eos, bos and pad),
    whose ``tokenizer_config.json`` carries a chat template. Returns the transformers model."""
    import json

    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END_OF_TEXT])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END_OF_TEXT, "bos_token": END_OF_TEXT,
              "pad_token": END_OF_TEXT, "chat_template": CHAT_TEMPLATE, "model_max_length": positions}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=BYTE_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=positions, initializer_range=0.1,
        bos_token_id=BYTE_VOCAB - 1, eos_token_id=BYTE_VOCAB - 1)).eval()
    model.save_pretrained(directory)
    return model
