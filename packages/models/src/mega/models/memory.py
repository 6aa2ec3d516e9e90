"""Parameters and saved activations of one pipeline stage on one rank, for ``mega plan``.

Counted tensor by tensor from what this package's layers keep for the backward pass (so a change
to a layer belongs here too; tests compare these figures with what a real forward saves):

    norm         its input, and per-token statistics (RMSNorm on the CPU also keeps x * rstd);
                 QK-norm the same per query and key head
    linear       its input (under sequence parallelism the all-gathered one: full sequence)
    attention    q, k, v, the output (which the projection keeps too) and fp32 log-sum-exp per
                 head and token; a fused kernel, so no [s, s] matrix
    MLP          the fc1 output (GELU or SwiGLU input) and the activation (fc2 input)
    dropout      its mask (bool on GPUs; the CPU kernel keeps it in the activation dtype)
    loss         fp32 softmax of the vocabulary shard, int64 targets

Under a zero-bubble schedule a micro-batch holds something else from its B to its W: its linears'
inputs and output gradients (:func:`layer_weight_grad_bytes`).

Regions outside tensor parallelism (norms, dropout, residuals) hold the whole hidden state on
every tensor-parallel rank, or 1/tp of its sequence under sequence parallelism. Context
parallelism gives each rank 1/cp of the sequence. Selective recompute drops what the attention
kernel keeps for itself; full recompute keeps only the input of each recomputed run of layers.
"""

from __future__ import annotations

from mega.core.footprint import StageFootprint
from mega.core.parallel import ParallelConfig
from mega.models.blocks.recompute import layer_runs
from mega.models.config import TransformerConfig

FP32, INT64 = 4, 8


def norm_elements(config: TransformerConfig) -> int:
    """One norm's parameters (LayerNorm's bias besides its weight)."""
    return config.hidden_size * (2 if config.normalization == "LayerNorm" else 1)


def stage_parameters(config: TransformerConfig, layers: int, *, pre_process: bool, post_process: bool,
                     tensor_parallel_size: int = 1) -> int:
    """Parameter elements one tensor-parallel rank holds for a stage of ``layers`` layers."""
    tp, h = tensor_parallel_size, config.hidden_size
    q, kv, ffn = config.query_projection_size, config.kv_projection_size, config.ffn_hidden_size
    fc1 = ffn * (2 if config.swiglu else 1)
    norm = norm_elements(config)
    bias = config.add_bias_linear
    # Column-parallel weights and biases split; row-parallel biases and norms are whole.
    layer = 2 * norm + (h * (q + 2 * kv) + q * h + h * fc1 + ffn * h) // tp
    layer += 2 * config.kv_channels if config.qk_layernorm else 0  # QK-norm's weights, whole on every rank
    layer += (q + 2 * kv) // tp if (bias or config.add_qkv_bias) else 0
    layer += (fc1 // tp + 2 * h) if bias else 0
    vocab_shard = config.padded_vocab_size(tp) * h // tp
    total = layers * layer
    if pre_process:
        total += vocab_shard
        if config.position_embedding_type == "learned_absolute":
            total += config.max_position_embeddings * h
    if post_process:
        total += norm
        tied_copy_needed = not pre_process  # a later stage's copy of the tied embedding
        if config.untie_embeddings_and_output_weights or tied_copy_needed:
            total += vocab_shard
    return total


def _dropout_mask_bytes(tensor_bytes: int, dtype_bytes: int, device_type: str) -> int:
    """The mask dropout keeps for a tensor: bool on GPUs, the tensor's dtype on the CPU."""
    return tensor_bytes if device_type != "cuda" else tensor_bytes // dtype_bytes


def _head_norm_bytes(config: TransformerConfig, tokens: int, tp: int, widths: int, dtype_bytes: int,
                     device_type: str) -> int:
    """QK-norm (``--qk-layernorm``): a norm per query and key head, over views of the fused QKV
    output (``widths`` channels per token); per-row fp32 statistics besides. torch's CPU rms_norm
    keeps an fp32 copy and x * rstd, and an fp32 model's strided view a contiguous copy too."""
    if not config.qk_layernorm:
        return 0
    rows = 2 if config.qk_layernorm_scope == "projection" else (config.num_attention_heads + config.num_query_groups) // tp
    statistics = tokens * rows * FP32  # one per head, or one per projection (--qk-layernorm-scope projection)
    if device_type != "cuda" and config.normalization == "RMSNorm":
        return tokens * widths * FP32 * (3 if dtype_bytes == FP32 else 2) + statistics
    return tokens * widths * dtype_bytes + statistics


def layer_activation_bytes(config: TransformerConfig, tokens: int, parallel: ParallelConfig,
                           dtype_bytes: int, device_type: str) -> tuple[int, int, int, dict[str, int]]:
    """For ``tokens`` = s/cp * b: (bytes one layer keeps besides what its first norm keeps of its
    input, what that norm keeps of it, the input's own size, and of the first: the ``attention``'s
    and the ``mlp``'s own parts, their inputs aside, for families whose layers differ there)."""
    tp = parallel.tp
    split = tp if parallel.sequence_parallel else 1
    q, kv = config.query_projection_size // tp, config.kv_projection_size // tp
    outside = tokens // split * config.hidden_size * dtype_bytes  # one norm/dropout/residual tensor
    statistics = tokens // split * FP32 * 2  # per-token mean/rstd
    norm_input = outside  # what a norm keeps of its input
    if device_type != "cuda" and config.normalization == "RMSNorm":
        # torch's CPU rms_norm keeps an fp32 copy of its input and x * rstd, not the input.
        norm_input = 2 * tokens // split * config.hidden_size * FP32

    # Grouped-query attention: torch's fused kernels take fewer key/value heads only on GPUs in
    # 16-bit; elsewhere the backend repeats them to every query head (new tensors).
    repeated = config.num_attention_heads > config.num_query_groups and not (device_type == "cuda" and dtype_bytes == 2)
    # Selective recompute keeps the kernel's inputs as they come: q and k rotated into new
    # tensors with RoPE, v (and q, k without RoPE) views of the fused qkv output.
    rope = config.position_embedding_type == "rope"
    as_given = q + kv + (q + 2 * kv) if rope else q + 2 * kv
    qkv_saved = 3 * q if repeated and config.recompute_granularity != "selective" else as_given
    # cos and sin (half the head width) per rotated tensor, shared when already in the dtype.
    rope_tables = config.seq_length * config.kv_channels // 2 * dtype_bytes * (2 if dtype_bytes == FP32 else 4)
    rope_tables = rope_tables if rope else 0
    attention = tokens * (qkv_saved + q) * dtype_bytes  # + the output, which the projection keeps
    if config.recompute_granularity != "selective":
        attention += tokens * config.num_attention_heads // tp * FP32  # the kernel's log-sum-exp

    attention += _head_norm_bytes(config, tokens, tp, q + kv, dtype_bytes, device_type)
    ffn = config.ffn_hidden_size // tp
    mlp = tokens * (ffn * (2 if config.swiglu else 1) + ffn) * dtype_bytes
    linear_inputs = 2 * tokens * config.hidden_size * dtype_bytes  # qkv and fc1, full sequence
    dropout = 2 * _dropout_mask_bytes(outside, dtype_bytes, device_type) if config.hidden_dropout > 0 else 0
    second_norm = norm_input + statistics  # the pre-MLP norm and the residual sum it normalises
    layer = statistics + linear_inputs + attention + rope_tables + mlp + dropout + second_norm
    return layer, norm_input, outside, {"attention": attention + rope_tables, "mlp": mlp}


def layer_weight_grad_bytes(config: TransformerConfig, tokens: int, parallel: ParallelConfig,
                            dtype_bytes: int) -> dict[str, int]:
    """What one layer's deferred weight-gradient products hold from its B to its W under a
    zero-bubble schedule (mega.core.parallel.weight_grad_split), by part (``attention``, ``mlp``):
    each linear's input and output gradient, of the whole sequence (a column-parallel input
    all-gathered under sequence parallelism, a row-parallel output before its reduce-scatter).
    Norms, and biases outside a linear, get their gradients in B and keep nothing."""
    tp, h = parallel.tp, config.hidden_size
    q, kv = config.query_projection_size // tp, config.kv_projection_size // tp
    ffn = config.ffn_hidden_size // tp
    fc1 = ffn * (2 if config.swiglu else 1)
    attention = tokens * ((h + q + 2 * kv) + (q + h)) * dtype_bytes  # qkv's input and output, the projection's
    mlp = tokens * ((h + fc1) + (ffn + h)) * dtype_bytes  # fc1's, fc2's
    return {"attention": attention, "mlp": mlp}


def output_layer_weight_grad_bytes(config: TransformerConfig, tokens: int, parallel: ParallelConfig,
                                   dtype_bytes: int, rebuilt: bool = True) -> int:
    """What the output layer's deferred weight gradient holds: its input and the loss's per-token
    statistics where W rebuilds the logits' gradient (mega.core.parallel.output_layer_loss: the
    target, whether this shard has it, the logits' maximum and sum of exponentials, the loss's
    gradient), else its input and the logits' gradient."""
    hidden = tokens * config.hidden_size * dtype_bytes
    if rebuilt:
        return hidden + tokens * (INT64 + 1 + 3 * FP32)
    return hidden + tokens * config.padded_vocab_size(parallel.tp) // parallel.tp * dtype_bytes


def stage_footprint(config: TransformerConfig, *, layers: int, pre_process: bool, post_process: bool,
                    parallel: ParallelConfig, micro_batch_size: int, dtype_bytes: int,
                    device_type: str = "cuda", first_layer: int | None = None) -> StageFootprint:
    """One rank of a stage holding ``layers`` layers, for one micro-batch (``ModelFamily.memory_model``;
    a dense model's layers are all alike: ``first_layer`` changes nothing)."""
    tp = parallel.tp
    tokens = config.seq_length // parallel.cp * micro_batch_size
    layer, norm_input, hidden, _ = layer_activation_bytes(config, tokens, parallel, dtype_bytes, device_type)
    kept, recompute = 0, 0
    for start, end, recomputed in layer_runs(config, layers):
        count = end - start
        if recomputed:
            kept += hidden  # the run's input, as it is
            recompute = max(recompute, count * (layer + norm_input))
        else:
            kept += count * (layer + norm_input)
    # Each layer counts its own input; a stage's output is sent on, not kept.
    if pre_process:
        kept += tokens * INT64 * 2  # token and position ids
        if config.hidden_dropout > 0:
            kept += _dropout_mask_bytes(hidden, dtype_bytes, device_type)  # the embedding's dropout
    if post_process:
        split = tp if parallel.sequence_parallel else 1
        kept += norm_input + tokens // split * FP32 * 2  # the final norm's input and statistics
        kept += tokens * config.hidden_size * dtype_bytes  # the output layer's input
        kept += tokens * config.padded_vocab_size(tp) // tp * FP32 + tokens * INT64  # softmax, targets
    parameters = stage_parameters(config, layers, pre_process=pre_process, post_process=post_process,
                                  tensor_parallel_size=tp)
    weight_grads = layers * sum(layer_weight_grad_bytes(config, tokens, parallel, dtype_bytes).values())
    if post_process:
        weight_grads += output_layer_weight_grad_bytes(config, tokens, parallel, dtype_bytes)
    return StageFootprint(parameters, kept, recompute, weight_grad_bytes=weight_grads)
