"""Megatron-LM's BERT names (megatron-core's pre-LN ``BertModel``): its layers are
``encoder.layers.N``; the masked-LM head is ``lm_head.dense``, ``lm_head.layer_norm`` and the tied
``output_layer`` (its bias of its own); ``pooler.dense`` and ``binary_head`` with the binary head.
Megatron-LM's args do not say BERT, so the masked-LM head in the files tells it (:func:`holds_bert`)."""

from __future__ import annotations

from mega.ckpt_convert.megatron.names.decoder import DECODER_ONLY
from mega.ckpt_convert.megatron.names.table import MegatronNames, register

BERT_NAMES = MegatronNames(
    layer_aliases=DECODER_ONLY.layer_aliases,  # Transformer Engine's fused norms, as the decoder's
    legacy_layer_prefix=None,
    tied_copies=("output_layer.weight",),  # a later last stage's copy of the word embedding
    extra_state_layer_modules=DECODER_ONLY.extra_state_layer_modules,
    extra_state_modules=("output_layer",),
    stacks=("encoder.layers.",),
)
MASKED_LM_HEAD = "lm_head.dense.weight"


def holds_bert(file_keys) -> bool:
    return any(key == MASKED_LM_HEAD or key.endswith("." + MASKED_LM_HEAD) for key in file_keys)


register(BERT_NAMES, "bert")
