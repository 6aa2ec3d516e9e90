"""``mega plan``'s memory model of the ``qwen3-next`` family: the mixture-of-experts families' one
(:mod:`mega.models.mixtral.memory`: experts, router, shared expert, embeddings, activations) with
each layer's attention parameters counted as its own mixer's: a Gated DeltaNet's projections,
convolution and decays, or a gated full attention's (its query projection twice as wide for the
gates), and the shared expert's gate. Activations are counted as for full attention layers of the model's heads (the linear
layers keep projections of a like width; their chunked states are a few per chunk)."""

from __future__ import annotations

import dataclasses

from mega.core.footprint import StageFootprint
from mega.core.parallel import ParallelConfig
from mega.models.mixtral.memory import moe_stage_footprint
from mega.models.qwen3_next.config import HybridLinearAttentionConfig
from mega.models.qwen3_next.model import mixer_parameters


def hybrid_stage_footprint(config: HybridLinearAttentionConfig, *, layers: int, pre_process: bool,
                           post_process: bool, parallel: ParallelConfig, micro_batch_size: int, dtype_bytes: int,
                           device_type: str = "cuda", first_layer: int | None = None) -> StageFootprint:
    footprint = moe_stage_footprint(config, layers=layers, pre_process=pre_process, post_process=post_process,
                                    parallel=parallel, micro_batch_size=micro_batch_size, dtype_bytes=dtype_bytes,
                                    device_type=device_type, first_layer=first_layer)
    if first_layer is None:
        first_layer = config.num_layers - layers if post_process and not pre_process else 0
    h, q, kv = config.hidden_size, config.query_projection_size, config.kv_projection_size
    counted = (h * (q + 2 * kv) + q * h) // parallel.tp + 2 * config.kv_channels  # the dense attention's
    linear, full = mixer_parameters(config, parallel.tp)
    own = sum(linear if config.is_linear_layer(n) else full for n in range(first_layer, first_layer + layers))
    mtp = (config.mtp_num_layers or 0) if post_process else 0  # each a full-attention layer
    own += mtp * full
    gates = (layers + mtp) * h if config.moe_shared_expert_gate else 0  # the shared expert's gate, whole on every rank
    return dataclasses.replace(footprint, parameters=footprint.parameters + own - (layers + mtp) * counted + gates)
