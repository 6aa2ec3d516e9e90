"""The word embedding each pipeline stage holds, and an output layer tied to it.

With tied embeddings the output layer uses the word embedding's parameter itself; a last stage
that is not also the first holds a copy of the word embedding under the same name. The weight
is marked with Megatron's ``shared_embedding`` attribute on both stages, so the pipeline
(:mod:`mega.core.pipeline.tied`) syncs the copies and sums their gradients over
``groups.embedding``. The tied weight is saved and loaded once, under the embedding's name.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

from mega.core.model_family import Stage
from mega.core.pipeline.tied import tie_across_stages

WORD_EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"


def stage_embedding(make: Callable[..., nn.Module], stage: Stage, tied: bool) -> nn.Module | None:
    """``make()`` on the first stage; on a later last stage whose output layer is tied, the copy
    of the word embedding alone (``make(words_only=True)``); None on the other stages."""
    if stage.is_first:
        embedding = make()
    elif stage.is_last and tied:
        embedding = make(words_only=True)
    else:
        return None
    if tied:
        tie_across_stages(embedding.word_embeddings.weight)
    return embedding


def tie_output_layer(model: nn.Module, output_layer: nn.Module, output_weight: str) -> None:
    """Make ``output_layer`` (whose weight ``model`` names ``output_weight``) use the weight of
    ``model.embedding.word_embeddings``; ``model``'s state dict holds it once, as the embedding's."""
    output_layer.weight = model.embedding.word_embeddings.weight
    model.register_state_dict_post_hook(partial(_drop_tied_output_weight, output_weight))
    model.register_load_state_dict_pre_hook(partial(_fill_tied_output_weight, output_weight))


def _drop_tied_output_weight(output_weight, module, state_dict, prefix, local_metadata):
    state_dict.pop(prefix + output_weight, None)


def _fill_tied_output_weight(output_weight, module, state_dict, prefix, local_metadata, strict, missing_keys,
                             unexpected_keys, error_msgs):
    if prefix + WORD_EMBEDDING_WEIGHT in state_dict:
        state_dict.setdefault(prefix + output_weight, state_dict[prefix + WORD_EMBEDDING_WEIGHT])
