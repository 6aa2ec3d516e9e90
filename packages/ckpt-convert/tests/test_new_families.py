"""Qwen3, Qwen3-MoE and DeepSeek-V3 as transformers computes them: tiny random Hugging Face models
saved to disk are converted to mega (written at tp2 x pp2, and ep2 for experts); the one-process
model and the tp2, pp2 and (experts) ep2 layouts, each on one world of 2 gloo ranks, give
transformers' logits and loss (fp32, 1e-5 relative); greedy generation equals transformers'
``generate`` token for token; mega -> Hugging Face gives back the files' tensors bit for bit.
Against megatron-core on the same world: a Qwen3-style (QK-norm) and a DeepSeek-style (MLA, first
layer dense, shared experts, expert bias, MTP) torch_dist checkpoint both ways, and DeepSeek's
shared experts (megatron-core's ``SharedExpertMLP`` at tp2) given the same weights."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import (  # noqa: E402
    VOCAB,
    generation_engine,
    greedy_as_transformers,
    input_ids,
    save_hf_model,
    tiny_random_model,
)

transformers = pytest.importorskip("transformers")

from mega.ckpt_convert import WriteOptions, convert  # noqa: E402
from mega.ckpt_convert.errors import ConversionError  # noqa: E402

TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
            initializer_range=0.1)
MODELS = {  # name -> (class, config class, settings, layouts (tp, pp, ep) on 2 ranks)
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config",
              dict(intermediate_size=96, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True),
              {"tp2": (2, 1, 1), "pp2": (1, 2, 1)}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(intermediate_size=96, moe_intermediate_size=48, num_key_value_heads=2, head_dim=16,
                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
                  {"tp2": (2, 1, 1), "ep2": (1, 1, 2), "pp2": (1, 2, 1)}),
    "deepseek-v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                    dict(intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4, n_shared_experts=1,
                         n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                         routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=12, rope_parameters={
                             "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 0.7}),
                    {"tp2": (2, 1, 1), "ep2": (1, 1, 2), "pp2": (1, 2, 1)}),
}
PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
NEW_TOKENS = 8


def make_model(name: str):
    class_name, config_name, settings, _ = MODELS[name]
    model = tiny_random_model(class_name, config_name, {**TINY, **settings}, name)
    with torch.no_grad():
        for name, buffer in model.named_buffers():  # DeepSeek-V3's expert bias: make it change the routing
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.05)
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, tmp_path_factory):
    name = request.param
    hf_model = make_model(name)
    root = tmp_path_factory.mktemp(name)
    hf_dir = save_hf_model(hf_model, root / "hf")
    mega_dir = root / "mega"
    ep = 2 if "ep2" in MODELS[name][3] else 1
    convert(hf_dir, mega_dir, to_format="mega",
            options=WriteOptions(tensor_parallel_size=2, pipeline_parallel_size=2, expert_parallel_size=ep))
    return name, hf_model, hf_dir, mega_dir


def hf_outputs(model, ids):
    with torch.no_grad():
        out = model(ids, labels=ids)
    return out.logits, out.loss


def layout_logits(mega_dir: str, ids: torch.Tensor, layout: tuple):
    from test_layout_logits import stage_logits

    from mega.core.parallel import ParallelConfig, ParallelGroups

    tp, pp, ep = layout
    return stage_logits(mega_dir, ids, ParallelGroups(ParallelConfig(tp=tp, pp=pp, ep=ep)))


def test_logits_equal_transformers_at_every_layout(case, worlds, assert_close):
    name, hf_model, _, mega_dir = case
    ids = input_ids()
    expected, expected_loss = hf_outputs(hf_model, ids)
    logits, loss = layout_logits(str(mega_dir), ids, (1, 1, 1))
    assert_close(logits, expected, what=f"{name} one process")
    assert_close(loss, expected_loss, what=f"{name} one process loss")
    for layout_name, layout in MODELS[name][3].items():
        last = [result for result in worlds.run(2, layout_logits, str(mega_dir), ids, layout) if result is not None]
        assert len(last) == 2 // layout[1], layout_name
        for logits, loss in last:
            assert_close(logits, expected, what=f"{name} {layout_name}")
            assert_close(loss, expected_loss, what=f"{name} {layout_name} loss")


def test_greedy_generation_equals_transformers(case):
    name, hf_model, _, mega_dir = case
    greedy_as_transformers(hf_model, generation_engine(mega_dir), PROMPTS, NEW_TOKENS, name)


def test_mega_to_hugging_face_is_bit_exact(case, tmp_path):
    from safetensors.torch import load_file

    name, _, hf_dir, mega_dir = case
    convert(mega_dir, tmp_path / "back", to_format="hf")
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original), name
    for tensor_name, tensor in original.items():
        assert torch.equal(back[tensor_name], tensor), f"{name} {tensor_name}"


def test_megatron_core_qwen3_imports_and_exports(worlds, tmp_path):
    """A genuine megatron-core GPTModel with --qk-layernorm (Qwen3's layers, tied) saved at tp2 by
    ``dist_checkpointing.save`` imports as the qwen3 family with megatron-core's tensors (its own tp1
    view), and mega's torch_dist export at tp2 loads back into megatron-core (``dist_checkpointing.load``)
with equal tensors."""
    ref = pytest.importorskip("megatron_reference")
    from mega.ckpt_convert import open_checkpoint
    from mega.core.checkpoint import read_tensors, tensor_shapes

    saved = tmp_path / "mcore" / "iter_0000007"
    worlds.run(2, ref.save_torch_dist, "qwen3", 2, str(saved))
    truth = worlds.run(2, ref.load_torch_dist, "qwen3", 1, str(saved))[0]
    convert(tmp_path / "mcore", tmp_path / "mega", from_format="megatron", to_format="mega")
    with open_checkpoint(str(tmp_path / "mega")) as source:
        assert source.family == "qwen3" and source.config.qk_layernorm
    names = list(tensor_shapes(tmp_path / "mega"))
    assert any("q_layernorm" in name for name in names)
    for name, tensor in read_tensors(tmp_path / "mega", names).items():
        assert torch.equal(tensor, truth[name]), name
    exported = tmp_path / "export"
    convert(tmp_path / "mega", exported, to_format="megatron",
            options=WriteOptions(tensor_parallel_size=2, megatron_format="torch_dist", iteration=7))
    loaded = worlds.run(2, ref.load_torch_dist, "qwen3", 1, str(exported / "iter_0000007"))[0]
    assert loaded.keys() == truth.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, truth[name]), name


def stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megatron-core's state dict with each layer's experts stacked as mega holds them
    (``mlp.experts.local_experts.E.linear_fc1.weight`` -> ``mlp.experts.linear_fc1.weight`` [experts, ...])."""
    stacked, experts = {}, {}
    for name, tensor in state.items():
        match = re.fullmatch(r"(.+\.mlp\.experts\.)local_experts\.(\d+)\.(.+)", name)
        if match:
            experts.setdefault(match.group(1) + match.group(3), {})[int(match.group(2))] = tensor
        else:
            stacked[name] = tensor
    for name, by_expert in experts.items():
        stacked[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return stacked


def test_megatron_core_deepseek_imports_and_exports(worlds, tmp_path):
    """A genuine megatron-core DeepSeek-style GPTModel (MLA, a dense then an MoE layer with a shared
    expert and expert bias, one MTP module), stepped twice by megatron-core's Adam, saved at tp2 by
    ``dist_checkpointing.save`` (one key per layer: its layers are not alike) imports with
    ``--with-optimizer`` as the deepseek-v3 family with megatron-core's tensors (its own tp1 view),
    and mega's torch_dist export at tp2 loads back into megatron-core's model and optimizer
    (``dist_checkpointing.load``, strict) with equal tensors and Adam state (the frozen expert
    biases have none)."""
    ref = pytest.importorskip("megatron_deepseek_reference")
    from mega.ckpt_convert import open_checkpoint
    from mega.core.checkpoint import read_tensors, tensor_shapes

    saved = tmp_path / "mcore" / "iter_0000007"
    worlds.run(2, ref.save_deepseek, 2, str(saved))
    truth, truth_adam = worlds.run(2, ref.load_deepseek, 1, str(saved))[0]
    truth = stacked_experts(truth)
    with_optimizer = WriteOptions(with_optimizer=True)
    convert(tmp_path / "mcore", tmp_path / "mega", from_format="megatron", to_format="mega", options=with_optimizer)
    with open_checkpoint(str(tmp_path / "mega")) as source:
        config = source.config
        assert source.family == "deepseek-v3" and config.mtp_num_layers == 1
        assert [config.is_moe_layer(n) for n in range(2)] == [False, True]
    names = list(tensor_shapes(tmp_path / "mega"))
    assert sorted(names) == sorted(truth)
    assert {"decoder.layers.1.mlp.router.expert_bias", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
            "decoder.layers.0.self_attention.kv_layernorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.transformer_layer.mlp.experts.linear_fc2.weight"} <= set(names)
    for name, tensor in read_tensors(tmp_path / "mega", names).items():
        assert torch.equal(tensor, truth[name]), name
    exported = tmp_path / "export"
    convert(tmp_path / "mega", exported, to_format="megatron", options=WriteOptions(
        tensor_parallel_size=2, megatron_format="torch_dist", iteration=7, with_optimizer=True))
    loaded, adam = worlds.run(2, ref.load_deepseek, 1, str(exported / "iter_0000007"))[0]
    loaded = stacked_experts(loaded)
    assert loaded.keys() == truth.keys() and adam.keys() == truth_adam.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, truth[name]), name
    for name, state in truth_adam.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(adam[name][key], state[key]), (name, key)
    with pytest.raises(ConversionError, match="torch_dist"):  # legacy files of it are refused, nothing written
        convert(tmp_path / "mega", tmp_path / "legacy", to_format="megatron", options=WriteOptions(megatron_format="legacy"))
    assert not (tmp_path / "legacy").exists()


def shared_experts_outputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(megatron-core's ``SharedExpertMLP`` at tp2 from whole weights split as its checkpoints
    split them, mega's ``SharedExperts`` on one device with the same weights) on one input."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mega.core.kernels import Kernels
    from mega.models.moe.shared_experts import SharedExperts

    ref = pytest.importorskip("megatron_reference")
    ref._shims()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(2, 1)
    rank = parallel_state.get_tensor_model_parallel_rank()
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                               moe_shared_expert_intermediate_size=24, gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, use_cpu_initialization=True, tensor_model_parallel_size=2)
    theirs = SharedExpertMLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                             gate=False, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    generator = torch.Generator().manual_seed(seed)
    fc1, fc2 = torch.randn(48, 16, generator=generator) * 0.3, torch.randn(16, 24, generator=generator) * 0.3
    hidden = torch.randn(5, 2, 16, generator=generator)
    gate, up = fc1.chunk(2)
    with torch.no_grad():  # each rank: its rows of gate and of up; its columns of fc2
        theirs.linear_fc1.weight.copy_(torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]))
        theirs.linear_fc2.weight.copy_(fc2.chunk(2, dim=1)[rank])
        ours = SharedExperts(16, 24, Kernels())
        ours.linear_fc1.weight.copy_(fc1)
        ours.linear_fc2.weight.copy_(fc2)
        return theirs(hidden), ours(hidden)


def test_shared_experts_equal_megatron_cores(worlds, assert_close):
    for theirs, ours in worlds.run(2, shared_experts_outputs, 3):
        assert_close(ours, theirs, what="shared experts")
