"""How a T5 is split into pipeline stages, and what crosses between them.

The encoder's layers and then the decoder's form one sequence of layers. With
``--pipeline-model-parallel-split-rank R`` (Megatron's flag) the first ``R`` stages split the
encoder evenly and the others the decoder; without it the whole sequence is split evenly, so a
stage may end the encoder and start the decoder (two stages of a model with as many encoder as
decoder layers: the encoder on one, the decoder on the other).

Every stage after the first reads the masks it needs from the micro-batch; what crosses
(:func:`boundary`) depends on where the stage ends: inside the encoder, its hidden state and
bias and the embedded decoder inputs; after it, the encoder output and the decoder's hidden
state (and bias once a decoder layer has computed it). Learned absolute positions send no bias.
"""

from __future__ import annotations

import torch

from mega.core.model_family import Stage, TensorSpec
from mega.core.parallel import ParallelConfig
from mega.core.pipeline.partition import PartitionError, split_layers
from mega.models.t5.config import T5Config

FIRST_STAGE_KEYS = ("text_enc", "text_dec", "enc_mask", "dec_mask")


def _ranges(config: T5Config, pp: int) -> list[tuple[range, range]]:
    """(encoder layers, decoder layers) of each stage."""
    encoder, decoder = config.num_layers, config.decoder_num_layers
    split_rank = config.pipeline_model_parallel_split_rank if pp > 1 else None
    if split_rank is None:
        blocks = [block[0] for block in split_layers(encoder + decoder, pp)]
    else:
        if not 0 < split_rank < pp:
            raise PartitionError(f"--pipeline-model-parallel-split-rank {split_rank} must be between 1 and "
                                 f"pipeline size - 1 = {pp - 1}")
        blocks = [block[0] for block in split_layers(encoder, split_rank)]
        blocks += [range(encoder + b.start, encoder + b.stop) for b, in split_layers(decoder, pp - split_rank)]
    return [(range(min(b.start, encoder), min(b.stop, encoder)),
             range(max(b.start, encoder) - encoder, max(b.stop, encoder) - encoder)) for b in blocks]


def pipeline_stages(config: T5Config, pp: int, vpp: int = 1) -> list[Stage]:
    if vpp != 1:
        raise PartitionError("the t5 family has no interleaved pipeline schedule (--num-layers-per-virtual-"
                             "pipeline-stage); use --pipeline-model-parallel-size alone")
    stages = []
    for index, (encoder, decoder) in enumerate(_ranges(config, pp)):
        keys = FIRST_STAGE_KEYS if index == 0 else ("enc_mask",) + (("dec_mask",) if decoder else ())
        stages.append(Stage(index, pp, {"encoder": encoder, "decoder": decoder}, keys))
    return stages


def boundary(config: T5Config, stage: Stage, micro_batch_size: int, parallel: ParallelConfig,
             dtype: torch.dtype) -> dict[str, TensorSpec]:
    """What ``stage`` sends on (see the module docstring); hidden states are split along the
    sequence under sequence parallelism, biases by heads under tensor parallelism."""
    shrink = parallel.tp if parallel.sequence_parallel else 1
    heads = config.num_attention_heads // parallel.tp
    enc, dec = config.seq_length, config.decoder_seq_length

    def hidden(seq: int) -> TensorSpec:
        return TensorSpec((seq // shrink, micro_batch_size, config.hidden_size), dtype)

    def bias(seq: int) -> TensorSpec:
        return TensorSpec((1, heads, seq, seq), dtype)

    encoder, decoder = stage.layers["encoder"], stage.layers["decoder"]
    if not decoder and encoder.stop < config.num_layers:  # inside the encoder
        specs = {"encoder_hidden": hidden(enc), "decoder_hidden": hidden(dec)}
        if config.relative:
            specs["encoder_bias"] = bias(enc)
        return specs
    specs = {"encoder_output": hidden(enc), "decoder_hidden": hidden(dec)}
    if decoder and config.relative:
        specs["decoder_bias"] = bias(dec)
    return specs
