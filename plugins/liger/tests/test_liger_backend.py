"""The liger adapters against mega's torch backend, and training with ``--kernels liger``.

Here (CI: no GPU, no Triton, no Liger) they run against the plain-torch stand-in of
``tests/liger_standin.py``, which checks the plumbing: layouts (``[s, b, h, d]`` vs Liger's
``[b, h, s, d]``), the in-place RoPE not touching the caller's tensor, contiguous GLU halves,
the padded vocabulary and the loss mask of the fused linear cross-entropy, its refusal under
tensor parallelism, and checkpoints that the torch backend loads. Where Liger, Triton and a CUDA
GPU are present the ``real`` cases run the same checks against the library at bf16 tolerance;
they are skipped here, with that reason.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from mega_liger.backend import LigerBackend

from mega.core.kernel_requirements import FixedGPU
from mega.models import torch_kernels

sys.path.insert(0, str(Path(__file__).parent))  # the stand-in is a test-support module beside this file
import liger_standin as standin  # noqa: E402


def _real_library_here() -> str:
    if not torch.cuda.is_available():
        return "no CUDA GPU here: only the stand-in ran (it checks the plumbing, not Liger's kernels)"
    try:
        importlib.import_module("liger_kernel.transformers.functional")
    except ImportError:
        return "liger-kernel (with triton) is not installed here: only the stand-in ran"
    return ""


@pytest.fixture(params=["standin", "real"])
def setup(request, monkeypatch):
    """(backend, device, dtype, tolerance, functional module)."""
    if request.param == "real":
        if reason := _real_library_here():
            pytest.skip(reason)
        return LigerBackend(), "cuda", torch.bfloat16, dict(atol=2e-2, rtol=2e-2)
    standin.install(monkeypatch)
    return LigerBackend(gpu=FixedGPU()), "cpu", torch.float32, dict(atol=1e-5, rtol=1e-5)


def _randn(*shape, seed=0, device="cpu", dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype).requires_grad_()


def _grads(out, inputs):
    grad = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view(out.shape)
    return torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_norms_equal_torch(setup, kind):
    """The adapter of each Liger norm; the backend serves LayerNorm from torch (it measured faster)."""
    from mega_liger.kernels import LigerNorm

    backend, device, dtype, tolerance = setup
    served = type(backend.component("norm")(kind, 32, 1e-5))
    assert served is (LigerNorm if kind == "RMSNorm" else torch.nn.LayerNorm)
    liger, reference = LigerNorm(kind, 32, 1e-5), torch_kernels.norm(kind, 32, 1e-5)
    with torch.no_grad():
        for module in (liger, reference):
            module.weight.copy_(torch.linspace(0.5, 1.5, 32))
            if getattr(module, "bias", None) is not None:
                module.bias.copy_(torch.linspace(-0.1, 0.1, 32))
    liger.to(device, dtype), reference.to(device, dtype)
    assert dict(liger.named_parameters()).keys() == dict(reference.named_parameters()).keys()
    x = _randn(6, 2, 32, device=device, dtype=dtype)
    out, expected = liger(x), reference(x)
    torch.testing.assert_close(out, expected, **tolerance)
    params = [x, liger.weight], [x, reference.weight]
    for grad, expected_grad in zip(_grads(out, params[0]), _grads(expected, params[1]), strict=True):
        torch.testing.assert_close(grad, expected_grad, **tolerance)


@pytest.mark.parametrize("positions", ["shared", "per sequence"])
def test_rotary_equals_torch_and_leaves_its_input_alone(setup, positions):
    from mega.models.blocks.rope import rotary_cos_sin
    from mega.models.config import TransformerConfig

    backend, device, dtype, tolerance = setup
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, position_embedding_type="rope")
    seq, batch = 8, 2
    position_ids = None if positions == "shared" else torch.tensor([list(range(seq)), list(range(3, 3 + seq))])
    cos, sin = rotary_cos_sin(config, seq, position_ids, torch.device(device))
    qkv = _randn(seq, batch, 4, 3 * 16, device=device, dtype=dtype)
    x = qkv[..., :16]  # a strided view, as attention's query is
    before = x.detach().clone()
    out, expected = backend.component("rotary")(x, cos, sin), torch_kernels.apply_rotary(x, cos, sin)
    assert out.shape == x.shape
    torch.testing.assert_close(out, expected, **tolerance)
    assert torch.equal(x.detach(), before)
    torch.testing.assert_close(_grads(out, [qkv])[0], _grads(expected, [qkv])[0], **tolerance)
    # the grouped query as attention hands it, [s, b, groups, queries per group, d] (cos/sin of the
    # same model tensors: Liger's whole-d angles made for the call above serve it)
    grouped = qkv[..., :32].unflatten(-1, (2, 16))
    out, expected = (rotate(grouped, cos[:, :, None], sin[:, :, None])
                     for rotate in (backend.component("rotary"), torch_kernels.apply_rotary))
    assert out.shape == grouped.shape
    torch.testing.assert_close(out, expected, **tolerance)
    torch.testing.assert_close(_grads(out, [qkv])[0], _grads(expected, [qkv])[0], **tolerance)


def test_liger_angles_are_made_once_per_model_tensors():
    """CPU. Liger's whole-d cos/sin serve every view of the model's two tensors (each layer's,
    the query's extra dimension), and are made again for new tensors (the next forward)."""
    from mega_liger.kernels import LigerAngles

    angles = LigerAngles()
    cos, sin = torch.randn(8, 1, 1, 4), torch.randn(8, 1, 1, 4)
    first = angles.of(cos, sin, torch.bfloat16)
    assert first[0].shape == (1, 8, 8) and first[0].dtype == torch.bfloat16
    torch.testing.assert_close(first[0].float(), torch.cat([cos, cos], -1)[:, :, 0].transpose(0, 1).bfloat16().float())
    assert angles.of(cos[:, :, None], sin[:, :, None], torch.bfloat16) is first
    assert angles.of(cos[:8], sin[:8], torch.bfloat16) is first
    assert angles.of(cos[:4], sin[:4], torch.bfloat16) is not first  # other rows
    again = cos.clone(), sin.clone()
    assert angles.of(*again, torch.bfloat16) is not first  # a new forward's tensors, equal or not


@pytest.mark.parametrize("name", ["swiglu", "geglu", "gelu"])
def test_activations_equal_torch(setup, name):
    backend, device, dtype, tolerance = setup
    x = _randn(4, 2, 2 * 24, device=device, dtype=dtype)
    out, expected = backend.component("activation")(name)(x), torch_kernels.activation(name)(x)
    if name == "geglu":  # Liger's GeGLU is the tanh approximation of GELU: close to torch's exact one
        torch.testing.assert_close(out, expected, atol=max(tolerance["atol"], 1e-3), rtol=0)
        gate, up = x.chunk(2, dim=-1)
        expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(out, expected, **tolerance)
    torch.testing.assert_close(_grads(out, [x])[0], _grads(expected, [x])[0], **tolerance)


def test_fused_linear_cross_entropy_equals_logits_then_loss(setup):
    """The sum over kept tokens of the cross-entropy, the padded vocabulary rows taking no part
    (their gradient stays zero), equals the torch backend's logits + vocab-aware cross-entropy."""
    backend, device, dtype, tolerance = setup
    vocab, padded, hidden_size, tokens = 100, 128, 32, 24
    hidden = _randn(tokens, hidden_size, seed=1, device=device, dtype=dtype)
    weight = _randn(padded, hidden_size, seed=2, device=device, dtype=dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(3)).to(device)
    loss_mask = (torch.arange(tokens) % 5 != 0).float().to(device)
    total = backend.component("linear_loss")(hidden, weight, labels, loss_mask, None, vocab)
    per_token = torch_kernels.loss(hidden @ weight.t(), labels, None, vocab)
    expected = (per_token * loss_mask).sum()
    torch.testing.assert_close(total.float(), expected, **tolerance)
    grads, expected_grads = torch.autograd.grad(total, [hidden, weight]), torch.autograd.grad(expected, [hidden, weight])
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, **tolerance)
    assert torch.count_nonzero(grads[1][vocab:]) == 0


def test_fused_linear_cross_entropy_refusals(monkeypatch):
    """Under tensor parallelism the run is refused before any work, and a model built directly
    at build time (naming the flags); the kernel itself refuses a split vocabulary and token
    weights other than 0 and 1."""
    from mega.core.config import ConfigError
    from mega.core.kernels import KernelBackendError, Kernels
    from mega.core.model_family import Stage
    from mega.core.parallel import ParallelConfig
    from mega.core.plugins import get_plugins
    from mega.models.blocks.language_model import LanguageModel
    from mega.models.config import TransformerConfig
    from mega.train.command import parse_run
    from mega.train.run_config import derive

    standin.install(monkeypatch)
    monkeypatch.setattr(get_plugins().kernel_backends.get("liger"), "gpu", FixedGPU())
    refusal = (r"--linear-loss-backend liger \(the output layer fused into the cross-entropy\) needs the whole "
               r"vocabulary on one rank, but --tensor-model-parallel-size is 2; add --linear-loss-backend torch")
    run, _ = parse_run(TINY + GPT + ["--kernels", "liger", "--tensor-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match=refusal):
        derive(run, world_size=2)
    derive(parse_run(TINY + GPT + ["--kernels", "liger", "--tensor-model-parallel-size", "2",
                                   "--linear-loss-backend", "torch"])[0], world_size=2)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100)
    with torch.device("meta"), pytest.raises(KernelBackendError, match=refusal):
        LanguageModel(config, Stage(0, 1, {"decoder": range(2)}), Kernels({"linear_loss": "liger"}),
                      ParallelConfig(tp=2))

    class SplitGroup:
        size = 2

    loss = LigerBackend(gpu=FixedGPU()).component("linear_loss")
    hidden, weight, labels = torch.randn(4, 8), torch.randn(16, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(KernelBackendError, match="whole vocabulary"):
        loss(hidden, weight, labels, torch.ones(4), SplitGroup(), 16)
    with pytest.raises(ValueError, match="0 or 1"):
        loss(hidden, weight, labels, torch.tensor([1.0, 0.5, 0.0, 1.0]), None, 16)


def test_is_available_names_what_is_missing(monkeypatch):
    if importlib.util.find_spec("liger_kernel") is None:
        assert LigerBackend().is_available() == (False, "liger-kernel >= 0.5.3 is not installed "
                                                        "(pip install -c constraints.txt 'liger-kernel >= 0.5.3')")
    functional = standin.install(monkeypatch)
    assert LigerBackend(gpu=FixedGPU((7, 0))).is_available() == (True, "")
    if not torch.cuda.is_available():
        assert LigerBackend().is_available() == (
            False, "a CUDA GPU of compute capability >= 7.0 (torch sees no CUDA device)")
    monkeypatch.setattr(importlib.import_module("liger_kernel"), "__version__", "0.5.2")
    assert LigerBackend(gpu=FixedGPU()).is_available() == (
        False, "liger-kernel >= 0.5.3 is needed, liger-kernel 0.5.2 is installed (pip install -c constraints.txt 'liger-kernel >= 0.5.3')")
    assert functional.calls == {}


# -- training --------------------------------------------------------------------------------

TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "100", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--lr-decay-style", "constant", "--eval-iters", "0", "--log-interval", "100",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5"]
LLAMA = ["--model-family", "llama", "--model-preset", "tiny", "--num-query-groups", "2", "--ffn-hidden-size", "64"]
GPT = ["--model-family", "gpt", "--model-preset", "tiny"]


def _train(argv):
    from mega.train.command import parse_run
    from mega.train.launch_run import run_training

    run, family = parse_run(argv)
    return run_training(run, family).losses


@pytest.fixture
def liger_here(monkeypatch):
    """The registered ``liger`` backend over the stand-in, its GPU requirement bypassed."""
    from mega.core.plugins import get_plugins

    functional = standin.install(monkeypatch)
    monkeypatch.setattr(get_plugins().kernel_backends.get("liger"), "gpu", FixedGPU())
    return functional


def test_llama_trains_with_liger_and_its_checkpoint_loads_into_torch(liger_here, tmp_path):
    straight = _train(TINY + LLAMA + ["--train-iters", "3"])
    with_liger = _train(TINY + LLAMA + ["--kernels", "liger", "--train-iters", "2", "--save", str(tmp_path)])
    # Every kind liger fills ran (norms, RoPE, SwiGLU, the fused loss), and the numbers are torch's.
    assert set(liger_here.calls) == {"liger_rms_norm", "liger_rope", "liger_swiglu", "liger_fused_linear_cross_entropy"}
    assert with_liger == pytest.approx(straight[:2], rel=1e-5)
    resumed_by_torch = _train(TINY + LLAMA + ["--train-iters", "3", "--load", str(tmp_path)])
    assert resumed_by_torch == pytest.approx(straight[2:], rel=1e-5)


def test_gpt_trains_with_liger(liger_here):
    straight = _train(TINY + GPT + ["--train-iters", "1"])
    with_liger = _train(TINY + GPT + ["--kernels", "liger", "--train-iters", "1"])
    assert set(liger_here.calls) == {"liger_fused_linear_cross_entropy"}  # LayerNorm: torch's (faster)
    assert with_liger == pytest.approx(straight, rel=1e-5)


def test_mega_train_without_the_library_fails_in_one_line_naming_it(capsys):
    """`mega train --kernels liger` where liger_kernel is absent: exit status 2 before any work, one line."""
    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger_kernel is installed here")
    from mega.train.command import main

    assert main(["--mock-data", "--model-family", "gpt", "--model-preset", "tiny", "--kernels", "liger",
                 "--train-iters", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "kernel backend 'liger' is not available: liger-kernel >= 0.5.3 is not installed" in lines[0]


def test_mega_plugins_shows_each_kernel_backend_and_whether_it_is_usable(capsys):
    from mega.core.cli.plugins_command import main

    assert main([]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["torch"].endswith("  yes")
    assert "activation, linear_loss, norm, rotary" in rows["liger"]
    if importlib.util.find_spec("liger_kernel") is None:
        assert rows["liger"].endswith("no: liger-kernel >= 0.5.3 is not installed (pip install -c constraints.txt 'liger-kernel >= 0.5.3')")


def test_the_fused_loss_across_pipeline_stages_equals_one_process(worlds):
    """pp2 with ``--kernels liger``: the last stage (holding its copy of the tied embedding) hands
    the fused loss its hidden states and output weight; the losses are one torch process's.
    CPU on every machine: the ranks and the one-process reference (a world of one) run on gloo."""
    argv = TINY + GPT + ["--train-iters", "2", "--num-layers", "4"]
    straight = worlds.run(1, standin.train_on_this_rank, argv)[0]
    ranks = worlds.run(2, standin.train_on_this_rank, argv + ["--kernels", "liger", "--pipeline-model-parallel-size", "2"])
    assert ranks[0] == ranks[1] and ranks[0] == pytest.approx(straight, rel=1e-5)


def test_a_compiled_stage_with_liger_components_traces(liger_here):
    """CPU, stand-in. ``--compile`` over a LLaMA stage whose norms, RoPE and SwiGLU are Liger's,
    and the fused loss compiled: the Liger calls stay out of the graph, the rest compiles
    (aot_eager: dynamo and AOTAutograd trace as for inductor, without a C compiler), and the
    numbers are eager's."""
    from mega.core.build import build_stage
    from mega.core.kernels import Kernels
    from mega.train.command import parse_run
    from mega.train.compile import compile_stage

    run, family = parse_run(TINY + LLAMA + ["--kernels", "liger"])
    kernels = Kernels(run.kernels.selection())
    eager = build_stage(family, run.model, kernels=kernels)
    compiled = compile_stage(family, build_stage(family, run.model, kernels=kernels), "aot_eager")
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = [module(tokens) for module in (eager, compiled)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-6)
    logits[1].square().mean().backward()
    assert {"liger_rms_norm", "liger_rope", "liger_swiglu"} <= set(liger_here.calls)

    loss = kernels.get("linear_loss")
    hidden, weight = _randn(8, 32, seed=1), _randn(128, 32, seed=2)
    labels, mask = torch.randint(0, 100, (8,), generator=torch.Generator().manual_seed(3)), torch.ones(8)
    traced = torch.compile(lambda h, w: loss(h, w, labels, mask, None, 100) * 2, backend="aot_eager")
    torch.testing.assert_close(traced(hidden, weight), loss(hidden, weight, labels, mask, None, 100) * 2)
