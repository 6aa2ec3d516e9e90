"""The flash-attn adapters against mega's torch backend.

Here (CI: no GPU, no flash-attention) they run against the plain-torch stand-in of
``tests/flash_attn_standin.py``, which checks the plumbing: layouts, GQA without repeated
heads, causal alignment, padding and packed sequences, dropout's RNG, FA3's selection, the
log-sum-exp and the private backward of block attention. Where flash-attention and a CUDA GPU
are present the ``real`` cases run the same checks against the library at bf16 tolerance;
they are skipped here, with that reason.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from mega_flash_attn.backend import FlashAttnBackend

from mega.core.kernel_requirements import FixedGPU
from mega.core.kernels import AttentionMask
from mega.models.torch_kernels import BlockAttention, sdpa_attention

sys.path.insert(0, str(Path(__file__).parent))  # the stand-in is a test-support module beside this file
import flash_attn_standin as standin  # noqa: E402


def _real_library_here() -> str:
    """"" when flash-attention and a CUDA GPU are both here, else why the real cases skip."""
    if not torch.cuda.is_available():
        return "no CUDA GPU here: only the stand-in ran (it checks the plumbing, not the kernels)"
    try:
        importlib.import_module("flash_attn")
    except ImportError:
        return "flash-attn is not installed here: only the stand-in ran"
    return ""


@pytest.fixture(params=["standin", "real"])
def setup(request, monkeypatch):
    """(backend, device, dtype, tolerance): the stand-in on the CPU in fp32 (exact up to
    rounding), or the real library on the GPU in bf16."""
    if request.param == "real":
        if reason := _real_library_here():
            pytest.skip(reason)
        return FlashAttnBackend(), "cuda", torch.bfloat16, dict(atol=2e-2, rtol=2e-2)
    standin.install(monkeypatch)
    return FlashAttnBackend(gpu=FixedGPU((8, 0))), "cpu", torch.float32, dict(atol=1e-5, rtol=1e-5)


def _qkv(batch, heads, kv_heads, q_len, k_len, head_dim, device, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def make(h, s):
        return torch.randn(batch, h, s, head_dim, generator=generator).to(device, dtype).requires_grad_()

    return make(heads, q_len), make(kv_heads, k_len), make(kv_heads, k_len)


def _forward_backward(fn, q, k, v, **kwargs):
    out = fn(q, k, v, **kwargs)
    grad = torch.ones_like(out) * torch.linspace(-1, 1, out.shape[-1], device=out.device, dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    return out, grads


MASKS = {
    "causal": (lambda b, s, dev: AttentionMask(causal=True), 2, 16, 16),
    "causal-continuing-a-prefix": (lambda b, s, dev: AttentionMask(causal=True), 2, 4, 16),
    "full": (lambda b, s, dev: AttentionMask(), 2, 16, 16),
    "padding": (lambda b, s, dev: AttentionMask(padding=torch.arange(s, device=dev)[None] < torch.tensor(
        [[s], [s - 5]], device=dev)), 2, 16, 16),
    "packed": (lambda b, s, dev: AttentionMask(causal=True, cu_seqlens=torch.tensor(
        [0, 5, 12, s], dtype=torch.int32, device=dev)), 1, 16, 16),
    "packed rows": (lambda b, s, dev: AttentionMask(causal=True, cu_seqlens=torch.tensor(
        [0, 5, s, s + 9, 2 * s], dtype=torch.int32, device=dev)), 2, 16, 16),
    "bias (runs torch's sdpa)": (lambda b, s, dev: AttentionMask(bias=torch.randn(
        1, 4, s, s, generator=torch.Generator().manual_seed(1)).to(dev)), 2, 16, 16),
}


@pytest.mark.parametrize("case", list(MASKS))
def test_attention_equals_torch_backend(setup, case):
    backend, device, dtype, tolerance = setup
    make_mask, batch, q_len, k_len = MASKS[case]
    q, k, v = _qkv(batch, 4, 2, q_len, k_len, 16, device, dtype)
    mask = make_mask(batch, k_len, device)
    flash = backend.component("attention")
    out, grads = _forward_backward(flash, q, k, v, mask=mask, softmax_scale=0.3)
    expected, expected_grads = _forward_backward(sdpa_attention, q, k, v, mask=mask, softmax_scale=0.3)
    torch.testing.assert_close(out, expected, **tolerance)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, **tolerance)
    if device == "cpu" and "bias" not in case:  # GQA reached the library with 2 key heads, not 4
        calls = importlib.import_module("flash_attn").calls
        assert calls and all(call[2][-2] == 2 for call in calls if call[0].startswith("flash_attn"))


def test_bias_falls_back_to_sdpa_and_never_calls_the_library(monkeypatch):
    fa2 = standin.install(monkeypatch)
    flash = FlashAttnBackend(gpu=FixedGPU()).component("attention")
    q, k, v = _qkv(1, 2, 2, 4, 4, 8, "cpu", torch.float32)
    flash(q, k, v, mask=AttentionMask(bias=torch.zeros(1, 2, 4, 4)))
    assert fa2.calls == []


def test_hopper_runs_fa3_unless_dropout_is_asked(monkeypatch):
    fa2 = standin.install(monkeypatch, hopper=True)
    flash = FlashAttnBackend(gpu=FixedGPU((9, 0))).component("attention")
    q, k, v = _qkv(1, 4, 4, 8, 8, 16, "cpu", torch.float32)
    flash(q, k, v, mask=AttentionMask(causal=True))
    flash(q, k, v, mask=AttentionMask(causal=True, cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32)))
    flash(q, k, v, mask=AttentionMask(causal=True), dropout_p=0.1)
    assert [call[0] for call in fa2.calls] == ["fa3", "fa3_varlen", "flash_attn_func"]
    ampere = FlashAttnBackend(gpu=FixedGPU((8, 0))).component("attention")
    ampere(q, k, v, mask=AttentionMask(causal=True))
    assert fa2.calls[-1][0] == "flash_attn_func"


def test_dropout_draws_from_torchs_rng_of_the_device(monkeypatch):
    """The caller's RNG fork (tensor-parallel dropout) governs flash-attention's dropout as it
    governs sdpa's: the same seed drops the same weights, another seed others."""
    standin.install(monkeypatch)
    flash = FlashAttnBackend(gpu=FixedGPU()).component("attention")
    q, k, v = _qkv(1, 2, 2, 8, 8, 8, "cpu", torch.float32)

    def run(seed, p):
        torch.manual_seed(seed)
        return flash(q, k, v, mask=AttentionMask(causal=True), dropout_p=p)

    assert torch.equal(run(1, 0.5), run(1, 0.5))
    assert not torch.equal(run(1, 0.5), run(2, 0.5))
    torch.testing.assert_close(run(1, 0.0), sdpa_attention(q, k, v, mask=AttentionMask(causal=True)))


BLOCKS = {"diagonal": (True, 8, 8, 16), "earlier keys": (False, 8, 8, 16), "GQA, head dim 12": (True, 8, 8, 12),
          "queries that see none of the keys": (True, 8, 4, 16)}


@pytest.mark.parametrize("case", list(BLOCKS))
def test_block_attention_equals_torch_reference(setup, case):
    backend, device, dtype, tolerance = setup
    causal, q_len, k_len, head_dim = BLOCKS[case]
    q, k, v = (t.detach() for t in _qkv(2, 4, 2, q_len, k_len, head_dim, device, dtype, seed=3))
    flash, reference = backend.component("block_attention"), BlockAttention()
    out, lse = flash.forward(q, k, v, causal=causal, softmax_scale=0.25)
    expected_out, expected_lse = reference.forward(q, k, v, causal=causal, softmax_scale=0.25)
    torch.testing.assert_close(out, expected_out, **tolerance)
    torch.testing.assert_close(lse[..., :q_len].float(), expected_lse.float(), **tolerance)
    if case.startswith("queries that see none"):
        # The final out/lse of such a query come from other blocks; give the backward finite ones.
        expected_lse = expected_lse.clamp_min(0.0)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    grads = flash.backward(grad_out, q, k, v, expected_out, expected_lse, causal=causal, softmax_scale=0.25)
    expected_grads = reference.backward(grad_out, q, k, v, expected_out, expected_lse, causal=causal,
                                        softmax_scale=0.25)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.shape == expected_grad.shape
        torch.testing.assert_close(grad, expected_grad, **tolerance)


def test_is_available_names_what_is_missing(monkeypatch):
    if importlib.util.find_spec("flash_attn") is None:
        usable, missing = FlashAttnBackend().is_available()
        assert not usable and missing == "flash-attn >= 2.7 is not installed (pip install -c constraints.txt flash-attn --no-build-isolation)"
    fa2 = standin.install(monkeypatch)
    assert FlashAttnBackend(gpu=FixedGPU((8, 0))).is_available() == (True, "")
    usable, missing = FlashAttnBackend(gpu=FixedGPU((7, 5))).is_available()
    assert not usable and "compute capability" in missing
    if not torch.cuda.is_available():
        assert FlashAttnBackend().is_available() == (
            False, "a CUDA GPU of compute capability >= 8.0 (torch sees no CUDA device)")
    fa2.__version__ = "2.5.8"
    assert FlashAttnBackend(gpu=FixedGPU()).is_available() == (
        False, "flash-attn >= 2.7 is needed, flash-attn 2.5.8 is installed (pip install -c constraints.txt flash-attn --no-build-isolation)")


def test_mega_train_without_the_library_fails_in_one_line_naming_it(capsys):
    """`mega train --kernels flash-attn` where flash_attn is absent: exit status 2 before any work, one line."""
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here")
    from mega.train.command import main

    assert main(["--mock-data", "--model-family", "gpt", "--model-preset", "tiny", "--kernels", "flash-attn",
                 "--train-iters", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "kernel backend 'flash-attn' is not available: flash-attn >= 2.7 is not installed" in lines[0]


def test_llama_trains_with_flash_attn_to_the_torch_backends_losses(monkeypatch):
    """The adapter inside the model (``[s, b, h, d]`` in, GQA, causal): the same losses as sdpa."""
    from mega.core.plugins import get_plugins
    from mega.train.command import parse_run
    from mega.train.launch_run import run_training

    fa2 = standin.install(monkeypatch)
    monkeypatch.setattr(get_plugins().kernel_backends.get("flash-attn"), "gpu", FixedGPU())
    argv = ["--mock-data", "--model-family", "llama", "--model-preset", "tiny", "--num-layers", "2",
            "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
            "--seq-length", "16", "--vocab-size", "100", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--lr", "1e-3", "--lr-decay-style", "constant", "--eval-iters", "0", "--log-interval", "100",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5", "--train-iters", "2"]
    straight = run_training(*parse_run(argv)).losses
    flash = run_training(*parse_run(argv + ["--use-flash-attn"])).losses
    assert flash == pytest.approx(straight, rel=1e-5)
    assert {call[:3] for call in fa2.calls} == {("flash_attn_func", (2, 16, 4, 8), (2, 16, 2, 8))}
