"""megatron-core's DeepSeek-style GPTModel as the reference for the deepseek-v3 torch_dist tests:
multi-latent attention (query and key/value latents with their norms, YaRN), the first layer dense
and the second a mixture of experts with a shared expert, sigmoid group routing and the expert
bias, and one multi-token-prediction module (``MultiTokenPredictionBlock``), built from its own
specs (``get_gpt_decoder_block_spec``, ``get_gpt_mtp_block_spec``, local modules) on the CPU.

Besides :mod:`megatron_reference`'s shims, two test-only ones let it build there: its local
``DotProductAttention`` does not take MLA's separate key and value widths, so the spec's core
attention (which holds no weights, and no entry in any state dict) is a weightless module; and its
MLA module asks ``isinstance(linear_proj, TELinear)`` of a Transformer Engine class that is absent
here, so it is told TE is absent. The model is used for its weights and files, not its outputs.
"""

from __future__ import annotations

import argparse

import torch
from megatron_reference import (
    SEQ,
    VOCAB,
    _shims,
    load_trained,
    padded_vocab,
    perturbed,
    save_trained,
)

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, q_lora_rank=32, kv_lora_rank=24,
             qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, rope_type="yarn", rotary_scaling_factor=4.0,
             original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.7, num_moe_experts=8,
             moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_router_topk=4,
             moe_router_num_groups=4, moe_router_group_topk=2, moe_router_score_function="sigmoid",
             moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_layer_freq=[0, 1],
             mtp_num_layers=1)


class _WeightlessCoreAttention(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()


def deepseek_megatron_args(tp: int, iteration: int) -> argparse.Namespace:
    """The args Megatron-LM's pretrain_gpt.py holds for this model (--multi-latent-attention ...)."""
    from megatron.core.enums import ModelType

    sizes = {key: value for key, value in MODEL.items() if key != "num_moe_experts"}
    return argparse.Namespace(
        **sizes, num_experts=MODEL["num_moe_experts"], multi_latent_attention=True, qk_layernorm=True,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=0.0, moe_router_bias_update_rate=1e-3, mtp_loss_scaling_factor=0.1,
        num_query_groups=MODEL["num_attention_heads"], group_query_attention=False, seq_length=SEQ,
        max_position_embeddings=SEQ, vocab_size=VOCAB, padded_vocab_size=padded_vocab(tp),
        make_vocab_size_divisible_by=128, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
        add_bias_linear=False, add_qkv_bias=False, norm_epsilon=1e-5, rotary_base=10000, rotary_percent=1.0,
        untie_embeddings_and_output_weights=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        params_dtype=torch.float32, model_type=ModelType.encoder_or_decoder, ckpt_format="torch_dist",
        iteration=iteration, tokenizer_type="NullTokenizer", transformer_impl="local")


def deepseek_model(tp: int, seed: int = 0):
    """This rank's part of the model at ``tp`` (the world's other ranks data-parallel)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    _shims()
    multi_latent_attention.HAVE_TE = False
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1)
    config = MLATransformerConfig(
        **MODEL, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, qk_layernorm=True,
        normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        perform_initialization=True, tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    config.sequence_parallel = False  # as megatron_reference._model: the check passed, torch's norms refuse it
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = _WeightlessCoreAttention
    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=padded_vocab(tp),
                     max_sequence_length=SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False,
                     mtp_block_spec=get_gpt_mtp_block_spec(config, block, use_transformer_engine=False))
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # the expert biases start at zero: make them count
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)
    return perturbed(model, seed)


def save_deepseek(tp: int, directory: str, iteration: int = 7, steps: int = 2) -> None:
    """What Megatron-LM's save_checkpoint writes with --ckpt-format torch_dist: the model after
    ``steps`` Adam steps of megatron-core's optimizer on random gradients (the same on every rank
    for a replicated parameter, as training makes them) and the optimizer's state."""
    save_trained(deepseek_model(tp), deepseek_megatron_args(tp, iteration), directory, iteration, steps,
                 torch.Generator().manual_seed(11))


def load_deepseek(tp: int, directory: str) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """megatron-core's dist_checkpointing.load of ``directory`` into a fresh model and optimizer at
    ``tp`` (strict, as Megatron-LM's load_checkpoint): its state dict (every tensor, the expert
    biases included) and the Adam state of each parameter by name."""
    model = deepseek_model(tp, seed=123)
    _, adam = load_trained(model, directory)
    return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}, adam
