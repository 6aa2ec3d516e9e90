"""Megatron-LM's BERT (``pretrain_bert.py``, megatron-core's ``BertModel``): its args (its names are in
:mod:`mega.ckpt_convert.megatron.names.bert`).

megatron-core's BERT is pre-LN (``input_layernorm`` and ``pre_mlp_layernorm`` before attention and
the MLP, ``encoder.final_layernorm`` after the last layer, no norm on the embeddings): mega's bert
family with ``--bert-pre-layernorm``, whose names are megatron-core's.

Megatron-LM's args do not say BERT (every run records ``bert_binary_head``), so a checkpoint is
BERT when its files hold the masked-LM head (``lm_head.dense.weight``) or ``--model-family bert``
says so; the args then give the shapes. A Hugging Face (post-LN) BERT is a different model and
is not written as Megatron-LM's.
"""

from __future__ import annotations

import argparse
from typing import Any

from mega.ckpt_convert.errors import ConversionError


def bert_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What only BERT reads from the args, beside the transformer's settings: pretrain_bert.py
    builds the binary head and two token types with ``bert_binary_head``, neither without."""
    binary = bool(getattr(args, "bert_binary_head", True))
    return {"bert_binary_head": binary, "num_tokentypes": 2 if binary else 0, "bert_pre_layernorm": True}


def bert_args(config, args: argparse.Namespace) -> None:
    """Add what pretrain_bert.py records to ``args`` (the transformer's), refusing a post-LN BERT."""
    if not config.bert_pre_layernorm:
        raise ConversionError("the bert model is post-LN (Hugging Face's BERT); Megatron-LM's BERT is pre-LN "
                              "(--bert-pre-layernorm), so its weights would make another model there")
    if config.num_tokentypes != (2 if config.bert_binary_head else 0):
        raise ConversionError(f"the bert model has {config.num_tokentypes} token types; pretrain_bert.py builds "
                              f"{2 if config.bert_binary_head else 0} with bert_binary_head={config.bert_binary_head}")
    args.bert_binary_head = config.bert_binary_head
