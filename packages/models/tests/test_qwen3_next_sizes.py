"""The ``qwen3-next`` family's sizes: the 80b-a3b preset is the published Qwen3-Next-80B-A3B shape
(its Hugging Face config.json read by the family's mapping gives the preset) with 79,674,391,296
parameters, 3,874,929,408 active per token (the model card's 80B and 3B activated: 3,252,599,552
without the word embedding and the output layer), its MTP module aside (1,650,471,424 more); the parameter count and the memory model's
parameters are the tiny model's own (``mega plan`` and ``--help`` on the preset: in
tests/test_qwen3_next_training.py). CPU, one process (models built on the meta device)."""

from __future__ import annotations

import dataclasses

from mega.core.build import build_stage
from mega.core.parallel import ParallelConfig
from mega.models.qwen3_next.family import FAMILY, PRESETS
from mega.models.qwen3_next.hf_qwen3_next import QWEN3_NEXT

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (its architecture keys).
PUBLISHED = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "decoder_sparse_step": 1,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000000, "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False, "vocab_size": 151936, "mtp_num_hidden_layers": 1,
}


def test_80b_preset_is_the_published_model():
    preset = PRESETS["80b-a3b"]
    published = QWEN3_NEXT.config_from_hf(PUBLISHED)
    shape = [field.name for field in dataclasses.fields(preset) if field.name not in ("seq_length",)]
    assert {name: getattr(published, name) for name in shape} == {name: getattr(preset, name) for name in shape}
    assert preset.mtp_num_layers == 1
    without_mtp = dataclasses.replace(preset, mtp_num_layers=None)  # what transformers loads, the card counts
    total, active = FAMILY.num_parameters(without_mtp), FAMILY.num_parameters(without_mtp, active=True)
    assert (total, active) == (79_674_391_296, 3_874_929_408)
    embeddings = 2 * preset.padded_vocab_size(1) * preset.hidden_size
    assert round(total / 1e9) == 80 and round((active - embeddings) / 1e9) == 3
    assert FAMILY.num_parameters(preset) - total == 1_650_471_424


def test_tiny_sizes_are_the_models_own():
    config = PRESETS["tiny"]
    model = build_stage(FAMILY, config, device="meta")
    held = sum(p.numel() for p in model.parameters())
    assert FAMILY.num_parameters(config) == held
    planned = FAMILY.memory_model(config, layers=config.num_layers, pre_process=True, post_process=True,
                                  parallel=ParallelConfig(), micro_batch_size=1, dtype_bytes=4, device_type="cpu")
    assert planned.parameters == held
