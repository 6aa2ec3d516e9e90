"""CPU. Attention runs without the copies it used to make (issue 31, item 4): the grouped query
is a view of the QKV output until the rotation writes it fresh, RoPE has no ``cat``, cos/sin are
made once per forward in the run's dtype, and the kernel's inputs are views. The counts come
from :mod:`mega.testing.copy_counts` (a dispatch mode that sees every ATen op, forward and
backward); the rotation is compared with transformers' ``apply_rotary_pos_emb``.

Before this change a tiny LLaMA layer made, per layer: 3 copies (the query's reshape, and the
keys and values repeated per query head on CPU), 2 ``cat`` forward and 3 backward (the rotary
halves, the QKV split's gradient), and in bf16 4 conversions of cos/sin.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from mega.core.build import build_stage
from mega.models.blocks.rope import rotary_cos_sin
from mega.models.config import TransformerConfig
from mega.models.deepseek_v3 import family as deepseek_v3
from mega.models.gpt import family as gpt
from mega.models.llama import family as llama
from mega.models.torch_kernels import apply_rotary
from mega.testing.copy_counts import count_copies

LAYERS, SEQ, BATCH = 2, 16, 2
# Per layer, within the attention module (forward and backward):
BOUND = {
    # the only cat: autograd's gradient of the QKV split, dQ dK dV into the projection's one output
    # gradient; the copies: keys and values repeated per query head, which CPU needs and CUDA's
    # bf16 kernels do not (native grouped-query attention, torch_kernels.NATIVE_GQA_DTYPES)
    "llama": {("cat", "backward"): 1, ("copy", "forward"): 2},
    "gpt": {("cat", "backward"): 1},
}
# DeepSeek-V3's multi-latent attention (fp32), as it stands: cats of the rope channels'
# de-interleaving (query and key), of the key's and the query's nope and rope parts, and three
# split gradients; the copy is the attention output (CPU runs MLA's unequal head sizes on the
# math kernel, which writes [b, h, s, d]). Its cos/sin (YaRN) are made once per forward too.
MLA_BOUND = {("cat", "forward"): 4, ("cat", "backward"): 3, ("copy", "forward"): 1}
MODELS = {
    "llama": (llama.FAMILY, llama.llama_config(LAYERS, 64, 128, 4, 2, vocab_size=128, seq_length=SEQ, llama3=True)),
    "gpt": (gpt.FAMILY, gpt.gpt_config(LAYERS, 64, 4, vocab_size=128, seq_length=SEQ, attention_dropout=0.0,
                                       hidden_dropout=0.0)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_attention_copies_per_layer_stay_at_the_bound(name, dtype):
    family, config = MODELS[name]
    model = build_stage(family, config, dtype=dtype, device="cpu")  # CPU on a GPU machine too
    attentions = [layer.self_attention for layer in model.decoder.layers.values()]
    tokens = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    per_row = torch.stack([torch.arange(SEQ), torch.arange(3, 3 + SEQ)])  # context parallelism's, packed rows'
    for positions in (None, per_row):
        counts = count_copies(lambda p=positions: model(tokens, p).float().square().mean().backward(), attentions)
        assert dict(counts.scoped) == {key: LAYERS * n for key, n in BOUND[name].items()}, positions
        assert counts.counts["cat", "forward"] == 0  # nowhere in the model's forward
        if name == "llama":  # cos and sin once per forward, not per layer
            assert counts.ops["cos"] == counts.ops["sin"] == 1


def test_the_counter_sees_copies_cats_and_conversions_inside_a_module_forward_and_backward():
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)

    def step():
        y = linear(torch.cat([x, x]).t().contiguous().t())  # a cat and a copy outside the module
        y.to(torch.float64).sum().backward()  # a conversion forward, its inverse backward

    counts = count_copies(step, [linear])
    assert dict(counts.counts) == {("cat", "forward"): 1, ("copy", "forward"): 1, ("convert", "forward"): 1,
                                   ("convert", "backward"): 1}
    assert dict(counts.scoped) == {}
    split = torch.nn.Module()
    split.forward = lambda t: torch.cat(t.split([1, 3], dim=-1)[::-1], dim=-1)
    x.requires_grad_()
    counts = count_copies(lambda: split(x).sum().backward(), [split])
    assert dict(counts.scoped) == {("cat", "forward"): 1, ("cat", "backward"): 1}  # split's gradient is a cat


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_rotation_of_a_grouped_query_view_equals_transformers(dtype):
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, position_embedding_type="rope")
    positions = torch.stack([torch.arange(SEQ), torch.arange(5, 5 + SEQ)])
    cos, sin = (t.to(dtype) for t in rotary_cos_sin(config, SEQ, positions, torch.device("cpu")))  # [s, b, 1, d/2]
    qkv = torch.randn(SEQ, BATCH, 2, 4 * 16, dtype=dtype, requires_grad=True)  # 2 groups of 2 queries, k, v
    query = qkv[..., :32].unflatten(-1, (2, 16))  # [s, b, groups, per group, d], a strided view
    ours = apply_rotary(query, cos[:, :, None], sin[:, :, None]).flatten(2, 3)
    # transformers: [b, heads, s, d] with cos/sin [b, s, d] over both halves
    full_cos, full_sin = (torch.cat([t, t], -1)[:, :, 0].transpose(0, 1) for t in (cos, sin))
    theirs, _ = apply_rotary_pos_emb(query.flatten(2, 3).permute(1, 2, 0, 3), query[..., 0, :].permute(1, 2, 0, 3),
                                     full_cos, full_sin)
    theirs = theirs.permute(2, 0, 1, 3)
    # fp32: equal to rounding; bf16: ours rounds x1 cos - x2 sin once (addcmul), theirs three times
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(ours, theirs, **tolerance)
    grad = torch.randn_like(ours)
    ours_grad, = torch.autograd.grad(ours, qkv, grad)
    theirs_grad, = torch.autograd.grad(theirs, qkv, grad)
    torch.testing.assert_close(ours_grad, theirs_grad, **tolerance)


def test_multi_latent_attention_makes_its_angles_once_and_stays_at_its_bound():
    model = build_stage(deepseek_v3.FAMILY, deepseek_v3.PRESETS["tiny"], device="cpu")
    attentions = [layer.self_attention for layer in model.decoder.layers.values()]
    tokens = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    counts = count_copies(lambda: model(tokens).float().square().mean().backward(), attentions)
    assert dict(counts.scoped) == {key: len(attentions) * n for key, n in MLA_BOUND.items()}
    assert counts.ops["cos"] == counts.ops["sin"] == 1
