"""``mega plan``'s memory model of the mixture-of-experts families (mixtral, qwen3-moe,
deepseek-v3): one rank of one pipeline stage, layer by layer, since their layers differ (the first
``--moe-layer-freq`` layers dense, the rest MoE) and the last stage holds the MTP modules.

Counted as :mod:`mega.models.memory` counts the dense layers (whose figures it reuses), from what
these layers keep for backward:

    MLA          the latents (the down projections' outputs) and their norms' inputs, the
                 up projections' inputs, the whole query and key built for the kernel, the
                 values (a view of the key/value up projection), the output and the log-sum-exp
    router       fp32 scores (sigmoid, or softmax) twice (the choice, the load-balancing loss's),
                 the top-k indices and weights
    experts      each routed (token, expert) slot's input row and fc1 output (the activation is
                 recomputed in the backward), its output row before the weighted sum, the
                 gather/scatter indices; slots are tokens x top-k whatever the expert-parallel
                 split (each rank runs the slots of its experts: balanced, tokens x top-k)
    shared       the shared experts as a dense SwiGLU MLP (fc1 output, activation)

Parameters: routed experts split over ``--expert-model-parallel-size`` (whole experts) and each
over ``--expert-tensor-parallel-size``, shared experts and MLA's up projections over the tensor
group (the down projections, latent norms and the router whole), the expert bias besides.

The planner passes a stage's layer count only: the first stage's layers start at 0, the last
stage's end at ``--num-layers``; a middle stage (or chunk) is taken to hold MoE layers where the
model has any (its dense layers are the first few), unless ``first_layer`` says where it starts.
"""

from __future__ import annotations

from mega.core.footprint import StageFootprint
from mega.core.parallel import ParallelConfig
from mega.models.blocks.recompute import layer_runs
from mega.models.memory import (
    FP32,
    INT64,
    layer_activation_bytes,
    layer_weight_grad_bytes,
    norm_elements,
    output_layer_weight_grad_bytes,
    stage_footprint,
    stage_parameters,
)


def _routed_parameters(config, parallel: ParallelConfig) -> int:
    """One MoE layer's routed experts on this rank (whole experts over ep, each split over etp)."""
    return config.num_experts // parallel.ep * 3 * config.hidden_size * config.moe_ffn_hidden_size // parallel.expert_tp


def _experts_parameters(config, parallel: ParallelConfig) -> int:
    """One MoE layer's router, routed experts (this rank's) and shared experts (its shard)."""
    h, tp = config.hidden_size, parallel.tp
    routed = _routed_parameters(config, parallel)
    shared = 3 * h * (config.moe_shared_expert_intermediate_size or 0) // tp
    bias = config.num_experts if getattr(config, "moe_router_enable_expert_bias", False) else 0
    return h * config.num_experts + routed + shared + bias


def _mla_parameters(config, tp: int) -> int:
    h, heads = config.hidden_size, config.num_attention_heads
    nope, rope, v, rank = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim, config.kv_lora_rank
    if config.q_lora_rank is None:
        query = h * heads * (nope + rope) // tp
    else:
        query = h * config.q_lora_rank + config.q_lora_rank + config.q_lora_rank * heads * (nope + rope) // tp
    return query + h * (rank + rope) + rank + (rank * heads * (nope + v) + heads * v * h) // tp


def _layer_parameters(config, moe: bool, parallel: ParallelConfig) -> int:
    """One layer's parameters on one rank: its attention, norms and MLP (dense or MoE)."""
    tp, h = parallel.tp, config.hidden_size
    dense = stage_parameters(config, 1, pre_process=False, post_process=False, tensor_parallel_size=tp)
    dense_mlp = (h * config.ffn_hidden_size * (3 if config.swiglu else 2)) // tp
    attention = dense - dense_mlp - 2 * norm_elements(config)
    if getattr(config, "multi_latent_attention", False):
        attention = _mla_parameters(config, tp)
    return attention + 2 * norm_elements(config) + (_experts_parameters(config, parallel) if moe else dense_mlp)


def _mtp_parameters(config, parallel: ParallelConfig) -> int:
    """The MTP modules (on the last stage): three norms, ``eh_proj`` (whole) and a layer like the last."""
    h = config.hidden_size
    layer = _layer_parameters(config, config.is_moe_layer(config.num_layers - 1), parallel)
    return (config.mtp_num_layers or 0) * (3 * norm_elements(config) + 2 * h * h + layer)


def _mla_attention_bytes(config, tokens: int, parallel: ParallelConfig, dtype_bytes: int, device_type: str) -> int:
    """What one multi-latent attention keeps (``tokens`` = s/cp * b), its input's norm aside."""
    tp, b, cpu = parallel.tp, dtype_bytes, device_type != "cuda"
    heads = config.num_attention_heads // tp
    nope, rope, v, rank = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim, config.kv_lora_rank
    q_rank = config.q_lora_rank or 0
    if cpu and config.normalization == "RMSNorm":  # torch's CPU rms_norm: an fp32 copy (the input in fp32) and x * rstd
        latents = tokens * (2 * (rank + q_rank) + (rope if b == FP32 else 0)) * FP32
    else:
        latents = tokens * (rank + rope + q_rank) * b  # the down projections' outputs
    latents += tokens * FP32 * (2 if q_rank else 1)  # the norms' statistics
    kept = latents + tokens * (rank + q_rank + heads * v) * b  # the up projections' inputs, the output
    query_key, values = 2 * tokens * heads * (nope + rope), tokens * heads * (nope + v)  # v: a view of kv_up's output
    if config.recompute_granularity == "selective":  # the recomputed kernel's inputs only
        kept += (query_key + values) * b
    elif cpu:  # values narrower than queries and keys: torch's math kernel, in fp32, with the [s, s] probabilities
        values = values if b == FP32 else tokens * heads * v
        kept += (query_key + values + tokens * heads * config.seq_length // parallel.cp) * FP32
    else:
        kept += (query_key + values) * b + tokens * heads * FP32  # and the kernel's log-sum-exp
    tables = config.seq_length // parallel.cp * rope // 2 * b * (2 if b == FP32 else 4)  # cos and sin
    return kept + tables


def _router_bytes(config, tokens: int) -> int:
    """The routing of ``tokens`` (the whole micro-batch's, on every tensor rank): fp32 scores for
    the choice and the load-balancing loss, top-k indices and weights."""
    experts, k = config.num_experts, config.moe_router_topk
    scores = 3 * tokens * experts * FP32 if config.moe_router_score_function == "sigmoid" else 2 * tokens * experts * FP32
    return scores + tokens * k * (INT64 + 3 * FP32 + 1)


def _moe_mlp_bytes(config, tokens: int, parallel: ParallelConfig, dtype_bytes: int) -> int:
    """One MoE MLP (routing, routed slots, shared experts) beside its input's norm; its input, which
    :mod:`mega.models.memory` counts whole (a dense fc1's, gathered under sequence parallelism),
    is the router's: this rank's slice there unless shared experts gather it."""
    h, k, b = config.hidden_size, config.moe_router_topk, dtype_bytes
    ffn = config.moe_ffn_hidden_size // parallel.expert_tp
    split = parallel.tp if parallel.sequence_parallel else 1
    slots = tokens * k
    # each slot's input row, fc1 output and output row, which the weighted sum keeps of this rank's tokens
    routed = slots * (2 * h + 2 * ffn) * b + tokens // split * k * h * b + 2 * slots * INT64
    if parallel.ep > 1 and config.moe_token_dispatcher_type == "alltoall":
        routed += slots * h * b  # the outputs as they come back, before they return to their slots
    shared = config.moe_shared_expert_intermediate_size or 0
    shared_bytes = tokens * 3 * (shared // parallel.tp) * b  # fc1 output and activation
    if not shared:
        shared_bytes -= (tokens - tokens // split) * h * b
    return _router_bytes(config, tokens) + routed + shared_bytes


def _layer_bytes(config, moe: bool, tokens: int, parallel: ParallelConfig, dtype_bytes: int,
                 device_type: str) -> int:
    """One layer's saved bytes, its first norm's share of its input included."""
    dense, norm_input, _, parts = layer_activation_bytes(config, tokens, parallel, dtype_bytes, device_type)
    layer = dense + norm_input
    if getattr(config, "multi_latent_attention", False):
        layer += _mla_attention_bytes(config, tokens, parallel, dtype_bytes, device_type) - parts["attention"]
    if moe:
        layer += _moe_mlp_bytes(config, tokens, parallel, dtype_bytes) - parts["mlp"]
    return layer


def _layer_weight_grad_bytes(config, moe: bool, tokens: int, parallel: ParallelConfig, dtype_bytes: int) -> int:
    """What one layer's deferred weight gradients hold from B to W (zero-bubble schedules): its
    linears' inputs and output gradients, as :func:`mega.models.memory.layer_weight_grad_bytes`
    counts them, with multi-latent attention's projections and the experts where the layer has them."""
    parts = layer_weight_grad_bytes(config, tokens, parallel, dtype_bytes)
    attention, mlp = parts["attention"], parts["mlp"]
    if getattr(config, "multi_latent_attention", False):
        attention = _mla_weight_grad_bytes(config, tokens, parallel, dtype_bytes)
    if moe:
        mlp = _moe_weight_grad_bytes(config, tokens, parallel, dtype_bytes)
    return attention + mlp


def _mla_weight_grad_bytes(config, tokens: int, parallel: ParallelConfig, dtype_bytes: int) -> int:
    """Multi-latent attention's projections, each its input and output: the down projections
    (whole on every rank), the up projections and the output projection (split over tp)."""
    h, tp = config.hidden_size, parallel.tp
    heads = config.num_attention_heads // tp
    nope, rope, v, rank = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim, config.kv_lora_rank
    query = heads * (nope + rope)
    if config.q_lora_rank is None:
        widths = h + query
    else:
        widths = (h + config.q_lora_rank) + (config.q_lora_rank + query)
    widths += (h + rank + rope) + (rank + heads * (nope + v)) + (heads * v + h)
    return tokens * widths * dtype_bytes


def _moe_weight_grad_bytes(config, tokens: int, parallel: ParallelConfig, dtype_bytes: int) -> int:
    """The experts' deferred weight gradients (the router's is B's: a plain ``nn.Linear``): per
    routed slot its input row, its output gradient, fc1's output gradient and fc2's input (the
    activation), whether one grouped GEMM each or the loop over experts; the shared experts as a
    dense SwiGLU MLP."""
    h, b = config.hidden_size, dtype_bytes
    ffn = config.moe_ffn_hidden_size // parallel.expert_tp
    per_slot = 2 * h + 3 * ffn
    shared = (config.moe_shared_expert_intermediate_size or 0) // parallel.tp
    shared_bytes = tokens * (2 * h + 3 * shared) * b if shared else 0
    return tokens * config.moe_router_topk * per_slot * b + shared_bytes


def _stage_layers(config, layers: int, pre_process: bool, post_process: bool, first_layer: int | None) -> list[bool]:
    """Whether each of the stage's layers is MoE (see the module's note on middle stages)."""
    if first_layer is None and not pre_process and not post_process:
        return [config.num_moe_layers > 0] * layers
    start = first_layer if first_layer is not None else (0 if pre_process else config.num_layers - layers)
    return [config.is_moe_layer(n) for n in range(start, start + layers)]


def moe_stage_footprint(config, *, layers: int, pre_process: bool, post_process: bool, parallel: ParallelConfig,
                        micro_batch_size: int, dtype_bytes: int, device_type: str = "cuda",
                        first_layer: int | None = None) -> StageFootprint:
    """One rank of a stage of ``layers`` layers for one micro-batch (``ModelFamily.memory_model``)."""
    moe_layers = _stage_layers(config, layers, pre_process, post_process, first_layer)
    tokens = config.seq_length // parallel.cp * micro_batch_size
    per_layer = [_layer_bytes(config, moe, tokens, parallel, dtype_bytes, device_type) for moe in moe_layers]
    # The dense model's stage of no layers: embeddings, final norm, output layer and loss.
    ends = stage_footprint(config, layers=0, pre_process=pre_process, post_process=post_process, parallel=parallel,
                           micro_batch_size=micro_batch_size, dtype_bytes=dtype_bytes, device_type=device_type)
    hidden = layer_activation_bytes(config, tokens, parallel, dtype_bytes, device_type)[2]
    kept, recompute = ends.activation_bytes, 0
    for start, end, recomputed in layer_runs(config, layers):
        run = sum(per_layer[start:end])
        kept += hidden if recomputed else run
        recompute = max(recompute, run) if recomputed else recompute
    parameters = ends.parameters + sum(_layer_parameters(config, moe, parallel) for moe in moe_layers)
    experts = sum(moe_layers) * _routed_parameters(config, parallel)
    weight_grads = ends.weight_grad_bytes + sum(
        _layer_weight_grad_bytes(config, moe, tokens, parallel, dtype_bytes) for moe in moe_layers)
    if post_process and getattr(config, "mtp_num_layers", None):
        last_moe = config.is_moe_layer(config.num_layers - 1)
        mtp_layer = _layer_bytes(config, last_moe, tokens, parallel, dtype_bytes, device_type)
        # each module: its layer, the joined norms' inputs and eh_proj's, its final norm, output layer and loss
        head = _mtp_head_bytes(config, micro_batch_size, parallel, dtype_bytes, device_type)
        kept += config.mtp_num_layers * (mtp_layer + head)
        # With MTP heads the output layer (theirs too) makes logits: its W holds their gradient.
        output = output_layer_weight_grad_bytes(config, tokens, parallel, dtype_bytes, rebuilt=False)
        weight_grads += output - output_layer_weight_grad_bytes(config, tokens, parallel, dtype_bytes)
        eh_proj = tokens * 3 * config.hidden_size * dtype_bytes  # its input (two joined) and output
        weight_grads += config.mtp_num_layers * (
            _layer_weight_grad_bytes(config, last_moe, tokens, parallel, dtype_bytes) + eh_proj + output)
        parameters += _mtp_parameters(config, parallel)
        experts += config.mtp_num_layers * config.is_moe_layer(config.num_layers - 1) * _routed_parameters(config, parallel)
        if not pre_process and config.untie_embeddings_and_output_weights:  # the MTP modules' word embedding
            parameters += config.padded_vocab_size(parallel.tp) * config.hidden_size // parallel.tp
    return StageFootprint(parameters, kept, recompute, expert_parameters=experts, weight_grad_bytes=weight_grads)


def _mtp_head_bytes(config, micro_batch_size: int, parallel: ParallelConfig, dtype_bytes: int,
                    device_type: str) -> int:
    """What one MTP module keeps besides its layer: the embedding's and the hidden state's norms,
    ``eh_proj``'s input (both, joined), the final norm, the output layer's input and the loss."""
    head = stage_footprint(config, layers=0, pre_process=False, post_process=True, parallel=parallel,
                           micro_batch_size=micro_batch_size, dtype_bytes=dtype_bytes,
                           device_type=device_type).activation_bytes
    tokens = config.seq_length // parallel.cp * micro_batch_size
    _, norm_input, hidden, _ = layer_activation_bytes(config, tokens, parallel, dtype_bytes, device_type)
    return head + 2 * norm_input + 2 * hidden * (parallel.tp if parallel.sequence_parallel else 1)
