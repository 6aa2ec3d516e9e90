"""The apex adapters against mega's torch backend and optimizer.

Here (CI: no GPU, no apex) they run against the plain-torch stand-in of ``tests/apex_standin.py``,
which checks the plumbing: the norms' parameters and arguments, when the fused softmax applies
(and that everything else runs sdpa), GQA, and FusedAdam's mapping of Megatron's Adam flags.
Where apex and a CUDA GPU are present the ``real`` cases run the same checks against apex at
bf16 tolerance; they are skipped here, with that reason.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from mega_apex.backend import ApexNorms, ApexSoftmax, FusedAdamFactory

from mega.core.kernel_requirements import FixedGPU
from mega.core.kernels import AttentionMask
from mega.models import torch_kernels

sys.path.insert(0, str(Path(__file__).parent))  # the stand-in is a test-support module beside this file
import apex_standin as standin  # noqa: E402


def _real_library_here() -> str:
    if not torch.cuda.is_available():
        return "no CUDA GPU here: only the stand-in ran (it checks the plumbing, not apex's kernels)"
    for module in ("fused_layer_norm_cuda", "amp_C", "scaled_upper_triang_masked_softmax_cuda"):
        try:
            importlib.import_module(module)
        except ImportError:
            return f"apex with its CUDA extensions ({module}) is not installed here: only the stand-in ran"
    return ""


@pytest.fixture(params=["standin", "real"])
def setup(request, monkeypatch):
    """(gpu probe or None, device, tolerance, stand-in call counts or None)."""
    if request.param == "real":
        if reason := _real_library_here():
            pytest.skip(reason)
        return None, "cuda", dict(atol=3e-2, rtol=3e-2), None
    return FixedGPU(), "cpu", dict(atol=3e-2, rtol=3e-2), standin.install(monkeypatch)


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_norms_equal_torch(setup, kind):
    gpu, device, _, calls = setup
    apex, reference = ApexNorms(gpu).component("norm")(kind, 32, 1e-5), torch_kernels.norm(kind, 32, 1e-5)
    with torch.no_grad():
        for module in (apex, reference):
            module.weight.copy_(torch.linspace(0.5, 1.5, 32))
            if getattr(module, "bias", None) is not None:
                module.bias.copy_(torch.linspace(-0.1, 0.1, 32))
    assert dict(apex.named_parameters()).keys() == dict(reference.named_parameters()).keys()
    apex.to(device), reference.to(device)
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
    out, expected = apex(x), reference(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.sum(), [x, apex.weight])
    expected_grads = torch.autograd.grad(expected.sum(), [x, reference.weight])
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)
    if calls is not None:
        assert calls == {"fused_rms_norm_affine" if kind == "RMSNorm" else "fused_layer_norm_affine": 1}


@pytest.mark.parametrize("case", ["causal GQA (the kernel)", "fp32 (sdpa)", "continuing a prefix (sdpa)",
                                  "padding (sdpa)"])
def test_fused_softmax_attention_equals_torch(setup, case):
    gpu, device, tolerance, calls = setup
    dtype = torch.float32 if case.startswith("fp32") else torch.bfloat16
    q_len = 8 if "prefix" in case else 32
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, q_len, 16, generator=generator).to(device, dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 32, 16, generator=generator).to(device, dtype).requires_grad_() for _ in range(2))
    mask = AttentionMask(causal=True, padding=torch.ones(2, 32, dtype=torch.bool, device=device)
                         if "padding" in case else None)
    attention = ApexSoftmax(gpu).component("attention")
    # The truth is fp32 attention of the same inputs; bf16 paths are held to bf16's tolerance.
    out = attention(q, k, v, mask=mask)
    expected = torch_kernels.sdpa_attention(q.float(), k.float(), v.float(), mask=mask)
    torch.testing.assert_close(out.float(), expected, **tolerance)
    grads = torch.autograd.grad(out.float().square().sum(), [q, k, v])
    expected_grads = torch.autograd.grad(expected.square().sum(), [q, k, v])
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.float(), expected_grad.float(), **tolerance)
    if calls is not None:
        fused = calls.get("scaled_upper_triang_masked_softmax_forward", 0)
        assert fused == (1 if case.startswith("causal") else 0)


def test_fused_adam_follows_megatrons_adam(monkeypatch):
    """``--optimizer apex-adam`` maps lr, betas, eps and decoupled weight decay as ``adam`` (torch's
    AdamW) does: the same parameters after three steps (stand-in FusedAdam: the mapping only)."""
    from mega.core.optim.config import OptimizerConfig
    from mega.core.optim.torch_optimizers import adam

    standin.install(monkeypatch)
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.9, adam_eps=1e-6)
    start = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    params = [torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())]
    optimizers = [FusedAdamFactory(FixedGPU())([{"params": [params[0]]}], config), adam([{"params": [params[1]]}], config)]
    for step in range(3):
        for param, optimizer in zip(params, optimizers, strict=True):
            param.grad = torch.full_like(param, 0.1 * (step + 1)) * param.detach().sign()
            optimizer.step()
    torch.testing.assert_close(params[0], params[1])


def test_is_available_names_what_is_missing(monkeypatch):
    if importlib.util.find_spec("apex") is None:
        usable, missing = ApexNorms().is_available()
        assert not usable and missing.startswith("apex is not installed (pip install -c constraints.txt -v --no-build-isolation")
        with pytest.raises(RuntimeError, match="--optimizer apex-adam needs apex is not installed"):
            FusedAdamFactory()([], None)
    standin.install(monkeypatch)
    for part in (ApexNorms, ApexSoftmax, FusedAdamFactory):
        assert part(FixedGPU((8, 0))).is_available() == (True, "")
    monkeypatch.delitem(importlib.import_module("sys").modules, "amp_C")
    usable, missing = FusedAdamFactory(FixedGPU()).is_available()
    assert not usable and missing.startswith("apex built with --cuda_ext (its amp_C extension) is not installed")


def test_train_refuses_apex_adam_before_any_work():
    """On a machine without apex, ``--optimizer apex-adam`` is refused by the run's checks."""
    if importlib.util.find_spec("apex") is not None:
        pytest.skip("apex is installed here")
    from mega.core.config import ConfigError
    from mega.train.command import parse_run
    from mega.train.run_config import derive

    run, _ = parse_run(["--mock-data", "--model-family", "gpt", "--model-preset", "tiny", "--optimizer", "apex-adam"])
    with pytest.raises(ConfigError, match=r"--optimizer apex-adam is not available: apex is not installed"):
        derive(run, world_size=1)


def test_mega_train_without_the_library_fails_in_one_line_naming_it(capsys):
    """`mega train --kernels apex` where apex is absent: exit status 2 before any work, one line."""
    if importlib.util.find_spec("apex") is not None:
        pytest.skip("apex is installed here")
    from mega.train.command import main

    assert main(["--mock-data", "--model-family", "gpt", "--model-preset", "tiny", "--kernels", "apex",
                 "--train-iters", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "kernel backend 'apex' is not available: apex is not installed" in lines[0]


def test_gpt_trains_with_apex_norms_and_fused_adam_and_torch_resumes_it(monkeypatch, tmp_path):
    """``--kernels apex --optimizer apex-adam`` reaches the torch run's losses (stand-ins: the
    plumbing), and its checkpoint (norms under torch's names, Adam's step per parameter) resumes
    with the torch backend and optimizer, and with apex's."""
    from mega.core.plugins import get_plugins
    from mega.train.command import parse_run
    from mega.train.launch_run import run_training

    calls = standin.install(monkeypatch)
    plugins = get_plugins()
    monkeypatch.setattr(plugins.kernel_backends.get("apex"), "gpu", FixedGPU())
    monkeypatch.setattr(plugins.optimizers.get("apex-adam"), "gpu", FixedGPU())
    argv = ["--mock-data", "--model-family", "gpt", "--model-preset", "tiny", "--num-layers", "2",
            "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "100",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3", "--lr-decay-style", "constant",
            "--eval-iters", "0", "--log-interval", "100", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--seed", "5"]
    straight = run_training(*parse_run(argv + ["--train-iters", "3"])).losses
    apex_run = argv + ["--kernels", "apex", "--optimizer", "apex-adam", "--train-iters", "2", "--save", str(tmp_path)]
    assert run_training(*parse_run(apex_run)).losses == pytest.approx(straight[:2], rel=1e-5)
    assert calls["fused_layer_norm_affine"] > 0
    resumed = run_training(*parse_run(argv + ["--train-iters", "3", "--load", str(tmp_path)])).losses
    assert resumed == pytest.approx(straight[2:], rel=1e-5)
    # FusedAdam counts steps per group; resumed, it continues the count the checkpoint holds.
    resumed_apex = argv + ["--kernels", "apex", "--optimizer", "apex-adam", "--train-iters", "3", "--load", str(tmp_path)]
    assert run_training(*parse_run(resumed_apex)).losses == pytest.approx(straight[2:], rel=1e-5)


def test_mega_plugins_says_whether_apex_adam_is_usable(capsys):
    from mega.core.cli.plugins_command import main

    assert main([]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["adam"].endswith("  yes") and "(optimizer)" in rows["apex-adam"]
    if importlib.util.find_spec("apex") is None:
        assert "no: apex is not installed" in rows["apex-adam"] and "no: apex is not installed" in rows["apex"]
