"""Config derivation and validation, vocabulary padding, flag metadata, and what the plugin registers."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from mega.core.kernels import KernelBackendError, get_kernel_backend, select_backends
from mega.core.model_family import ModelFamily
from mega.core.plugins import get_plugins, hookimpl, load_plugins
from mega.models.config import ModelConfigError, TransformerConfig
from mega.models.gpt.family import PRESETS as GPT_PRESETS

GPT_TINY = GPT_PRESETS["tiny"]


def test_derived_sizes_follow_megatron():
    config = TransformerConfig(hidden_size=4096, num_attention_heads=32, seq_length=2048)
    assert (config.ffn_hidden_size, config.kv_channels, config.num_query_groups) == (16384, 128, 32)
    assert config.max_position_embeddings == 2048
    assert TransformerConfig(hidden_size=4096, num_attention_heads=32, swiglu=True).ffn_hidden_size == 10880
    assert config.attention_softmax_scale == pytest.approx(128**-0.5)


def test_a_preset_derives_what_it_did_not_choose_from_the_values_in_force():
    """A preset's derived sizes follow the flags that override what they derive from; what the
    preset chose (LLaMA-3 8B's 8 query groups and 14336-wide MLP) stays."""
    from mega.train.command import parse_run

    def model(*argv):
        return parse_run([*argv, "--mock-data"])[0].model

    resized = model("--model-preset", "tiny", "--hidden-size", "4096", "--num-attention-heads", "32")
    assert (resized.kv_channels, resized.num_query_groups, resized.ffn_hidden_size) == (128, 32, 16384)
    assert model("--model-preset", "tiny") == GPT_TINY
    llama = model("--model-family", "llama", "--model-preset", "llama3-8b", "--hidden-size", "2048")
    assert (llama.kv_channels, llama.num_query_groups, llama.ffn_hidden_size) == (64, 8, 14336)
    given = model("--model-preset", "tiny", "--hidden-size", "128", "--kv-channels", "16")
    assert (given.kv_channels, given.ffn_hidden_size) == (16, 512)


@pytest.mark.parametrize(("vocab", "divisible_by", "tp", "padded"), [
    (50257, 128, 1, 50304), (50257, 128, 2, 50432), (50257, 128, 8, 51200), (32000, 128, 8, 32768),
    (128256, 128, 8, 129024), (256, 128, 2, 256), (100, 1, 1, 100),
])
def test_vocab_is_padded_as_megatron_pads_it(vocab, divisible_by, tp, padded):
    config = TransformerConfig(vocab_size=vocab, make_vocab_size_divisible_by=divisible_by)
    assert config.padded_vocab_size(tp) == padded


@pytest.mark.parametrize(("fields", "tp", "message"), [
    (dict(num_attention_heads=4, num_query_groups=3), 1, "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (dict(num_attention_heads=4, num_query_groups=2), 4, "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    (dict(num_attention_heads=6, hidden_size=96), 4, "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
    (dict(seq_length=128, max_position_embeddings=64), 1, "--seq-length 128 exceeds --max-position-embeddings 64"),
    (dict(recompute_granularity="full"), 1, "needs --recompute-method uniform or block"),
    (dict(recompute_granularity="full", recompute_method="block"), 1, "needs --recompute-num-layers >= 1"),
    (dict(recompute_method="uniform"), 1, "--recompute-method uniform needs --recompute-granularity full"),
    (dict(normalization="BatchNorm"), 1, "--normalization must be LayerNorm or RMSNorm, got 'BatchNorm'"),
    (dict(hidden_dropout=1.5), 1, "--hidden-dropout must be in"),
    (dict(num_layers=0), 1, "--num-layers must be a positive integer, got 0"),
])
def test_bad_configs_fail_naming_the_flags(fields, tp, message):
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(")):
        TransformerConfig(**fields).validate(tp)


def test_every_field_declares_its_flag_and_help():
    for field in dataclasses.fields(TransformerConfig):
        assert "flag" in field.metadata and field.metadata["help"], field.name
        flag = field.metadata["flag"]
        assert flag is None or flag.startswith("--"), field.name
    flags = {f.name: f.metadata["flag"] for f in dataclasses.fields(TransformerConfig)}
    assert flags["layernorm_epsilon"] == "--norm-epsilon" and flags["add_bias_linear"] == "--disable-bias-linear"


def test_families_and_the_torch_backend_are_registered():
    plugins = get_plugins()
    for name in ("gpt", "llama"):
        family = plugins.models.get(name)
        assert isinstance(family, ModelFamily) and family.name == name and "tiny" in family.presets
    assert {"175b", "1.3b"} <= set(plugins.models.get("gpt").presets)
    assert {"llama2-7b", "llama2-70b", "llama3-8b", "llama3-405b"} <= set(plugins.models.get("llama").presets)
    torch_backend = get_kernel_backend("torch", "attention", plugins)
    assert torch_backend.name == "torch"
    assert torch_backend.kinds == {"attention", "norm", "linear", "activation", "rotary", "loss", "block_attention"}
    with pytest.raises(KeyError, match="no preset '7b'; presets: tiny, llama2-7b"):
        plugins.models.get("llama").preset("7b")


class _Unavailable:
    name, kinds = "fake-flash", frozenset({"attention"})

    def is_available(self):
        return False, "flash-attn is not installed (pip install flash-attn) and needs a CUDA GPU"


class _NormKernel:
    name, kinds = "fused-norm", frozenset({"norm"})

    def is_available(self):
        return True, ""


class _FakeKernels:
    @hookimpl
    def register_kernel_backends(self, register):
        register("fake-flash", _Unavailable())
        register("fused-norm", _NormKernel())


def test_attention_backend_errors_say_what_is_missing():
    plugins = load_plugins(extra=[("fake-kernels", _FakeKernels())])
    with pytest.raises(KernelBackendError, match="'fake-flash' is not available: flash-attn is not installed"):
        get_kernel_backend("fake-flash", "attention", plugins)
    with pytest.raises(KernelBackendError, match="'fused-norm' fills norm, not 'attention'"):
        get_kernel_backend("fused-norm", "attention", plugins)
    with pytest.raises(KeyError, match="no kernel backend 'torc'; did you mean torch"):
        get_kernel_backend("torc", "attention", plugins)
    # A preset takes every kind its backend fills; per-kind choices override it.
    assert select_backends("fused-norm", plugins=plugins)["norm"] == "fused-norm"
    assert select_backends("fused-norm", plugins=plugins)["attention"] == "torch"
    assert select_backends("fused-norm", {"norm": "torch"}, plugins)["norm"] == "torch"
    with pytest.raises(KernelBackendError, match="'fake-flash' is not available"):
        select_backends(overrides={"attention": "fake-flash"}, plugins=plugins)


def test_registering_imports_no_torch():
    code = ("import sys; from mega.core.plugins import load_plugins; p = load_plugins(); "
            "assert {'gpt', 'llama'} <= set(p.models.names()); assert 'torch' in p.kernel_backends; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    environment = {**os.environ, "MEGA_LOAD_PLUGINS": "models"}
    subprocess.run([sys.executable, "-c", code], check=True, env=environment)
