"""``mega plan``'s memory model of the gpt-oss family: the mixture-of-experts model's
(:mod:`mega.models.mixtral.memory`) and what gpt-oss's own layers keep besides, per layer:

    sink attention   written out in torch (:mod:`mega.models.gpt_oss.attention`): its
                     probabilities, ``heads / tp x seq / cp x (seq + 1)`` values a sequence, and
                     the key and value heads repeated for every query head; no log-sum-exp
    experts          besides fc1's output (counted by the MoE model; the clamped SwiGLU keeps
                     only it, :func:`~mega.models.gpt_oss.experts.clamped_swiglu`), the activation
                     fc2 keeps (the MoE model's fused experts recompute it): one ``ffn``-wide row a
                     routed slot

Selective recompute rebuilds one layer's attention in the backward, full recompute a run's
layers. Parameters: the MoE model's, the router's and experts' biases and the sinks.
"""

from __future__ import annotations

import dataclasses

from mega.core.footprint import StageFootprint
from mega.core.parallel import ParallelConfig
from mega.models.blocks.recompute import layer_runs
from mega.models.memory import FP32
from mega.models.mixtral.memory import moe_stage_footprint

EXPERT_ROWS_BESIDE_FC1 = 1  # ffn-wide rows a routed slot keeps beyond fc1's output (see above)


def _attention_bytes(config, parallel: ParallelConfig, micro_batch_size: int, dtype_bytes: int,
                     device_type: str) -> int:
    """What the sink attention keeps beyond the fused kernel the dense model counts."""
    tp, seq = parallel.tp, config.seq_length
    tokens = seq // parallel.cp * micro_batch_size
    heads = config.num_attention_heads // tp
    q, kv = config.query_projection_size // tp, config.kv_projection_size // tp
    probabilities = micro_batch_size * heads * (seq // parallel.cp) * (seq + 1) * dtype_bytes
    # The dense model's kernel saves the key/value heads repeated except on GPUs in 16-bit.
    fused_repeats = config.num_attention_heads > config.num_query_groups and not (
        device_type == "cuda" and dtype_bytes == 2)
    rotated_and_given = 2 * q + 3 * kv  # rotated q and k, the qkv output v is a view of
    repeated = 0 if fused_repeats else tokens * (3 * q - rotated_and_given) * dtype_bytes
    return probabilities + repeated - tokens * heads * FP32  # (no log-sum-exp)


def _bias_parameters(config, parallel: ParallelConfig) -> tuple[int, int]:
    """(one layer's router and expert biases and sinks on this rank, of which the routed
    experts'); the attention's biases the dense model counts, and the dense MLP's biases it
    counts with them are not there."""
    sinks = config.num_attention_heads // parallel.tp if config.softmax_type == "learnable" else 0
    experts = config.num_experts // parallel.ep * (2 * config.moe_ffn_hidden_size // parallel.expert_tp
                                                   + config.hidden_size)
    dense_mlp = 2 * config.ffn_hidden_size // parallel.tp + config.hidden_size if config.add_bias_linear else 0
    return sinks + config.num_experts + experts - dense_mlp, experts


def gpt_oss_stage_footprint(config, *, layers: int, pre_process: bool, post_process: bool, parallel: ParallelConfig,
                            micro_batch_size: int, dtype_bytes: int, device_type: str = "cuda",
                            first_layer: int | None = None) -> StageFootprint:
    """One rank of a stage of ``layers`` layers for one micro-batch (``ModelFamily.memory_model``)."""
    footprint = moe_stage_footprint(config, layers=layers, pre_process=pre_process, post_process=post_process,
                                    parallel=parallel, micro_batch_size=micro_batch_size, dtype_bytes=dtype_bytes,
                                    device_type=device_type, first_layer=first_layer)
    if not layers:
        return footprint
    biases, expert_biases = _bias_parameters(config, parallel)
    footprint = dataclasses.replace(footprint, parameters=footprint.parameters + layers * biases,
                                    expert_parameters=footprint.expert_parameters + layers * expert_biases)
    slots = config.seq_length // parallel.cp * micro_batch_size * config.moe_router_topk
    experts = slots * EXPERT_ROWS_BESIDE_FC1 * (config.moe_ffn_hidden_size // parallel.expert_tp) * dtype_bytes
    attention = _attention_bytes(config, parallel, micro_batch_size, dtype_bytes, device_type) \
        if config.softmax_type == "learnable" else 0
    if config.recompute_granularity == "selective":  # the attention is rebuilt, one layer's at a time
        return dataclasses.replace(footprint, activation_bytes=footprint.activation_bytes + layers * experts,
                                   recompute_bytes=footprint.recompute_bytes + attention)
    runs = layer_runs(config, layers)
    kept = sum(end - start for start, end, recomputed in runs if not recomputed)
    rebuilt = max((end - start for start, end, recomputed in runs if recomputed), default=0)
    return dataclasses.replace(footprint, activation_bytes=footprint.activation_bytes + kept * (experts + attention),
                               recompute_bytes=footprint.recompute_bytes + rebuilt * (experts + attention))
