"""DeepSeek-V3's generation cache holds the compressed latent and the rotated rope key, not keys
and values: ``kv_lora_rank + qk_pos_emb_head_dim`` values per token per layer; decoding token by
token through it gives the cache-free forward's logits. And the expert bias moves after a
step by the loads the layers counted (the callback ``mega train`` runs)."""

from __future__ import annotations

import dataclasses
import types

import torch

from mega.core.build import build_stage
from mega.models.blocks.kv_cache import KVCache
from mega.models.deepseek_v3.family import FAMILY, PRESETS
from mega.models.moe.expert_bias import ExpertBiasUpdate
from mega.models.moe.layer import MoELayer
from mega.models.moe.routing import updated_expert_bias

CONFIG = dataclasses.replace(PRESETS["tiny"], vocab_size=256, seq_length=16, mtp_num_layers=None)


def test_cache_holds_the_latent_and_rope_key_and_decodes_like_the_whole_forward(assert_close):
    model = build_stage(FAMILY, CONFIG, seed=3, training=False).eval()
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    cache = KVCache(16)
    with torch.no_grad():
        whole = model(ids)  # [s, b, vocab]
        steps = [model(ids[:, :6], inference_cache=cache, logits_to_keep=1)]
        steps += [model(ids[:, t:t + 1], inference_cache=cache, logits_to_keep=1) for t in range(6, 10)]
    for layer in range(CONFIG.num_layers):
        held = cache.layer(layer)
        per_token = (held.keys[:, :, :held.length].numel() + held.values[:, :, :held.length].numel()) // (2 * held.length)
        assert per_token == CONFIG.kv_lora_rank + CONFIG.qk_pos_emb_head_dim
    for step, logits in zip(range(5, 10), steps, strict=True):
        assert_close(logits[0], whole[step], what=f"position {step}")


def test_expert_bias_moves_by_the_step_loads():
    model = build_stage(FAMILY, CONFIG, seed=3)
    update = ExpertBiasUpdate(rate=0.01)
    update.on_stage_built(model, types.SimpleNamespace(dp_cp=types.SimpleNamespace(size=1)))
    [moe] = [module for module in model.modules() if isinstance(module, MoELayer)]
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids).sum().backward()
    model(ids).sum().backward()  # two micro-batches: their loads add up
    load = moe.tokens_per_expert.clone()
    assert load.sum() == 2 * 2 * 16 * CONFIG.moe_router_topk
    update.on_optimizer_step_end(None, 1)
    assert torch.equal(moe.router.expert_bias, updated_expert_bias(torch.zeros_like(load), load, 0.01))
    assert moe.router.expert_bias.abs().sum() > 0 and moe.tokens_per_expert.sum() == 0

