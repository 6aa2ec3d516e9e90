"""Each model family's names in Megatron-LM's files (:mod:`.table` the shape of a table and the
functions over it); importing the package registers every family's table."""

from mega.ckpt_convert.megatron.names import bert, decoder, t5  # noqa: F401  (each registers its table)
from mega.ckpt_convert.megatron.names.table import (
    LAYER_PREFIX,
    MegatronNames,
    expert_of,
    expert_of_file_key,
    mega_name,
    names_for,
    split_layer,
    split_stack_layer,
    stack_sizes,
    stacked_expert,
    torch_dist_name,
)

__all__ = ["LAYER_PREFIX", "MegatronNames", "expert_of", "expert_of_file_key", "mega_name", "names_for",
           "split_layer", "split_stack_layer", "stack_sizes", "stacked_expert", "torch_dist_name"]
