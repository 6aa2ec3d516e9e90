"""The transformer-engine backend, checked on the CPU against a stand-in for Transformer Engine
(tests/te_standin.py: TE's documented call signatures in plain torch). What the stand-in proves is
the plumbing - which TE modules mega builds and with which arguments, TE's own tensor/sequence-
parallel communication, fp8_autocast around every forward with the recipe of the flags, and
checkpoints that move between TE and torch-native runs - not TE's kernels. The tests at the end
run the same comparisons against the real TE on a GPU and are skipped where there is none.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import te_standin  # noqa: E402

STANDIN = "transformer-engine-standin"
TINY = ["--mock-data", "--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-3", "--lr-decay-style", "constant", "--eval-iters", "0",
        "--log-interval", "100", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5"]
FAMILIES = {"gpt": ["--model-family", "gpt"], "llama": ["--model-family", "llama", "--num-query-groups", "2"]}
WITH_TE = ["--kernels", STANDIN]


def standin_backend():
    """The real adapter code under another name, on a machine that reports TE 2.0 on an H100."""
    from mega_transformer_engine.availability import Environment
    from mega_transformer_engine.backend import TransformerEngineBackend

    backend = TransformerEngineBackend(probe=lambda: Environment("2.0.0", True, (9, 0)))
    backend.name = STANDIN
    return backend


def use_standin() -> te_standin.FP8State:
    """Install the stand-in as ``transformer_engine`` and register its backend (idempotent; also
    called inside the ranks of a multi-process world)."""
    from mega.core.plugins import get_plugins, hookimpl

    state = te_standin.install()
    plugins = get_plugins()
    if STANDIN not in plugins.kernel_backends:
        class Plugin:
            @hookimpl
            def register_kernel_backends(self, register):
                register(STANDIN, standin_backend())

        plugins.add(Plugin(), "te-standin-test")
    return state


@pytest.fixture(scope="module")
def standin():
    saved = {name: sys.modules.get(name) for name in list(sys.modules) if name.startswith("transformer_engine")}
    yield use_standin()
    for name in [name for name in sys.modules if name.startswith("transformer_engine")]:
        del sys.modules[name]
    sys.modules.update({name: module for name, module in saved.items() if module is not None})


def train(argv):
    from mega.train.command import parse_run
    from mega.train.launch_run import run_training

    run, family = parse_run(argv)
    return run_training(run, family).losses


def hide_standin(monkeypatch):
    """This machine as it is: no ``transformer_engine`` module, even while the stand-in is in use."""
    for name in [name for name in sys.modules if name.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, name)


# -- what is missing, on this machine and in words --------------------------------------------
def test_is_available_names_what_is_missing():
    from mega_transformer_engine.availability import Environment

    nothing = Environment(None, False, None).missing()
    assert "transformer-engine >= 1.13 is not installed" in nothing and "no CUDA GPU" in nothing
    assert "1.11.0 is installed, >= 1.13 is needed" in Environment("1.11.0", True, (9, 0)).missing()
    ampere = Environment("2.1.0", True, (8, 0))
    assert ampere.missing() == ""
    assert "compute capability >= 8.9" in ampere.missing(fp8=True) and "is 8.0" in ampere.missing(fp8=True)
    assert Environment("2.1.0", True, (9, 0)).missing(fp8=True) == ""


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed here")
@pytest.mark.parametrize("flags", [["--transformer-impl", "transformer_engine"], ["--kernels", "transformer-engine"],
                                   ["--fp8-format", "hybrid"]])
def test_train_refuses_before_any_work(flags, capsys, monkeypatch):
    from mega.train.command import main

    hide_standin(monkeypatch)

    assert main(TINY + FAMILIES["gpt"] + ["--train-iters", "1"] + flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    if flags[0] == "--fp8-format":
        assert "--fp8-format needs" in err and "Transformer Engine" in err
    else:
        assert "transformer-engine >= 1.13 is not installed" in err


def test_mega_plugins_lists_the_backend_and_why_it_is_unusable(capsys, monkeypatch):
    from mega.core.cli.plugins_command import main

    hide_standin(monkeypatch)

    assert main([]) == 0
    out = capsys.readouterr().out.split("kernel backend or optimizer")[1]
    line = next(line for line in out.splitlines() if line.strip().startswith("transformer-engine "))
    if importlib.util.find_spec("transformer_engine") is None:
        assert "no: transformer-engine >= 1.13 is not installed" in line


# -- the stand-in: layouts, names, numbers, checkpoints ------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_te_modules_compute_what_torch_computes_and_checkpoints_move(standin, family, tmp_path):
    from mega.core.build import build_stage
    from mega.core.checkpoint.sharded_io import read_index
    from mega.core.kernels import Kernels, select_backends
    from mega.core.plugins import get_plugins
    from mega.train.command import parse_run

    base = TINY + FAMILIES[family]
    run, model_family = parse_run(base + ["--train-iters", "4"])
    kernels = Kernels(select_backends(STANDIN), get_plugins())
    model = build_stage(model_family, run.model, kernels=kernels)
    layer = model.decoder.layers["0"]
    assert type(layer.self_attention.linear_qkv).__name__ == "TELayerNormLinear"
    assert type(layer.self_attention.linear_proj).__name__ == "TELinear"
    if family == "llama":  # SwiGLU: TE's LayerNormMLP holds the norm, fc1, the activation and fc2
        assert type(layer.mlp).__name__ == "TELayerNormMLP" and layer.mlp.activation == "swiglu"
        assert layer.mlp.normalization == "RMSNorm"
    else:  # GPT's exact GELU is not TE's (tanh) "gelu": LayerNormLinear, GELU, Linear
        assert type(layer.mlp.linear_fc1).__name__ == "TELayerNormLinear"
        assert type(layer.mlp.linear_fc2).__name__ == "TELinear"
    assert isinstance(model.decoder.final_layernorm, te_standin.RMSNorm if family == "llama" else te_standin.LayerNorm)
    assert layer.input_layernorm is None and layer.self_attention.linear_qkv.normalization == run.model.normalization
    assert layer.pre_mlp_layernorm is None

    straight = train(base + ["--train-iters", "4"])
    te_ckpt, torch_ckpt = tmp_path / "te", tmp_path / "torch"
    first = train(base + WITH_TE + ["--train-iters", "2", "--save", str(te_ckpt)])
    assert first == pytest.approx(straight[:2], rel=1e-5)
    keys = set(read_index(te_ckpt / "iter_0000002"))
    assert "model.decoder.layers.0.input_layernorm.weight" in keys
    assert "model.decoder.layers.1.pre_mlp_layernorm.weight" in keys
    assert "model.decoder.layers.1.mlp.linear_fc1.weight" in keys and "model.decoder.layers.1.mlp.linear_fc2.weight" in keys
    assert not any("layer_norm_weight" in key or "fc1_weight" in key for key in keys)
    assert "buffer.decoder.layers.0.self_attention.linear_qkv._extra_state.tp0of1" in keys
    assert train(base + ["--train-iters", "4", "--load", str(te_ckpt)]) == pytest.approx(straight[2:], rel=1e-5)
    train(base + ["--train-iters", "2", "--save", str(torch_ckpt)])
    assert train(base + WITH_TE + ["--train-iters", "4", "--load", str(torch_ckpt)]) == pytest.approx(
        straight[2:], rel=1e-5)


def test_layer_norm_mlp_outputs_and_gradients_equal_torch(standin):
    """TE's LayerNormMLP for GPT (biases; --openai-gelu, TE's tanh "gelu") and LLaMA (SwiGLU, no
    biases): the model's logits and every gradient, by canonical name, equal the torch backend's."""
    import torch

    from mega.core.build import build_stage
    from mega.core.checkpoint.state import named_parameters
    from mega.core.kernels import Kernels, select_backends
    from mega.core.plugins import get_plugins
    from mega.train.command import parse_run

    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    for family, extra in (("gpt", ["--openai-gelu"]), ("llama", [])):
        run, model_family = parse_run(TINY + FAMILIES[family] + extra + ["--train-iters", "1"])
        results = []
        for kernels in (Kernels(), Kernels(select_backends(STANDIN), get_plugins())):
            model = build_stage(model_family, run.model, kernels=kernels)
            logits = model(tokens)
            (logits.float() * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
            grads = {name: param.grad for name, param in named_parameters([model])[0].items()}
            results.append((logits, grads, model.decoder.layers["1"]))
        (torch_logits, torch_grads, _), (te_logits, te_grads, te_layer) = results
        assert type(te_layer.mlp).__name__ == "TELayerNormMLP", family
        torch.testing.assert_close(te_logits, torch_logits, msg=family)
        assert te_grads.keys() == torch_grads.keys()
        if family == "gpt":
            assert {"decoder.layers.1.mlp.linear_fc1.bias", "decoder.layers.1.mlp.linear_fc2.bias",
                    "decoder.layers.1.pre_mlp_layernorm.bias"} <= te_grads.keys()
        for name, grad in torch_grads.items():
            torch.testing.assert_close(te_grads[name], grad, msg=f"{family}: {name}")


def test_standin_layer_norm_mlp_returns_bias_and_norm_output_as_te_documents(standin):
    import torch

    te = sys.modules["transformer_engine.pytorch"]
    torch.manual_seed(0)
    plain = te.LayerNormMLP(8, 12, activation="swiglu", normalization="RMSNorm", device="cpu")
    split = te.LayerNormMLP(8, 12, activation="swiglu", normalization="RMSNorm", device="cpu", return_bias=True,
                            return_layernorm_output=True)
    split.load_state_dict(plain.state_dict())
    torch.nn.init.normal_(plain.fc2_bias)
    split.fc2_bias.data.copy_(plain.fc2_bias)
    assert plain.fc1_weight.shape == (24, 8) and plain.fc2_weight.shape == (8, 12)  # [gate; up] stacked
    x = torch.randn(5, 2, 8)
    out, bias, ln_out = split(x)
    torch.testing.assert_close(out + bias, plain(x))  # fc2's bias left out, and returned
    torch.testing.assert_close(ln_out, torch.nn.functional.rms_norm(x, (8,), plain.layer_norm_weight, 1e-5))


def test_attention_masks_and_gqa_match_torch(standin):
    import torch
    from mega_transformer_engine.layers import TEAttention

    from mega.core.config import ConfigError
    from mega.core.kernels import AttentionMask
    from mega.models.torch_kernels import sdpa_attention

    attention = TEAttention(sys.modules["transformer_engine.pytorch"])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=gen)
    k, v = torch.randn(2, 2, 6, 8, generator=gen), torch.randn(2, 2, 6, 8, generator=gen)
    padding = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    bias = torch.randn(1, 4, 6, 6, generator=gen)
    for mask in (AttentionMask(causal=True), AttentionMask(), AttentionMask(causal=True, padding=padding),
                 AttentionMask(bias=bias)):
        got = attention(q, k, v, mask=mask, softmax_scale=0.3)
        torch.testing.assert_close(got, sdpa_attention(q, k, v, mask=mask, softmax_scale=0.3), msg=str(mask))
    # fewer queries than keys (a cached prefix): mega's causal mask aligns at the end
    got = attention(q[:, :, -2:], k, v, mask=AttentionMask(causal=True))
    torch.testing.assert_close(got, sdpa_attention(q[:, :, -2:], k, v, mask=AttentionMask(causal=True)))
    with pytest.raises(ConfigError, match="--attention-backend transformer-engine does not take packed sequences"):
        attention(q, k, v, mask=AttentionMask(cu_seqlens=torch.tensor([0, 3, 6])))
    with pytest.raises(ConfigError, match="--attention-backend transformer-engine takes a padding mask only"):
        attention(q[:, :, -2:], k, v, mask=AttentionMask(causal=True, padding=padding))


# -- FP8: the recipe from the flags, fp8_autocast around every forward ---------------------------
def test_fp8_autocast_wraps_every_forward_with_the_flags_recipe(standin):
    flags = ["--fp8-format", "e4m3", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max",
             "--fp8-margin", "1"]
    fmt, history, algo, margin = "E4M3", 16, "max", 1
    standin.events.clear()
    losses = train(TINY + FAMILIES["gpt"] + WITH_TE + ["--train-iters", "2"] + flags)
    assert len(losses) == 2
    # 2 steps x 2 micro-batches: one forward each, each entered and left once
    assert [event[0] for event in standin.events] == ["enter", "exit"] * 4
    recipes = {id(event[1]) for event in standin.events if event[0] == "enter"}
    assert len(recipes) == 1
    recipe = standin.events[0][1]
    assert (recipe.fp8_format.name, recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin) == (
        fmt, history, algo, margin)
    assert standin.enabled is False  # left after the last forward


def test_fp8_runs_linear_layers_under_autocast_and_keeps_their_state(standin, tmp_path):
    from mega.core.build import build_stage
    from mega.core.checkpoint import load_model_weights
    from mega.core.kernels import Kernels, select_backends
    from mega.core.plugins import get_plugins
    from mega.train.command import parse_run

    argv = TINY + FAMILIES["llama"] + WITH_TE + ["--train-iters", "2", "--fp8-hybrid"]  # Megatron's older flag
    standin.events.clear()
    train(argv + ["--save", str(tmp_path)])
    recipe = standin.events[0][1]
    assert (recipe.fp8_format.name, recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin) == (
        "HYBRID", 1, "most_recent", 0)  # Megatron's defaults
    run, family = parse_run(argv)
    model = build_stage(family, run.model, kernels=Kernels(select_backends(STANDIN), get_plugins()), init=False)
    load_model_weights(tmp_path, [model])
    layer = model.decoder.layers["1"]
    # every forward ran in FP8 (4 of them), and the count came back from the checkpoint's extra state
    assert layer.self_attention.linear_qkv.fp8_forwards == layer.mlp.fp8_forwards == 4  # the MLP: LayerNormMLP


def test_fp8_flags_refused_clearly(standin):
    from mega.core.config import ConfigError
    from mega.train.command import parse_run
    from mega.train.run_config import derive

    def check(argv):  # what `mega train` does before any work
        derive(parse_run(TINY + FAMILIES["gpt"] + argv)[0], 1)

    with pytest.raises(ConfigError, match="--fp8-param-gather is not supported: it needs FP8 parameter tensors"):
        check(WITH_TE + ["--fp8-format", "hybrid", "--fp8-param-gather"])
    with pytest.raises(ConfigError, match="--fp8-param-gather needs --fp8-format"):
        check(WITH_TE + ["--fp8-param-gather"])
    with pytest.raises((ConfigError, ValueError), match="contradicts --fp8-format e4m3"):
        check(WITH_TE + ["--fp8-format", "e4m3", "--fp8-hybrid"])
    with pytest.raises(ConfigError, match="--fp8-format needs"):
        check(["--fp8-format", "e4m3"])


# -- tensor and sequence parallelism by TE's own communication (2 ranks) ------------------------
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"],
           "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"]}


def train_with_standin(argvs):
    """Each run's losses, its fp8_autocast entries and the ranks of the amax groups they named."""
    import torch.distributed as dist

    state = use_standin()
    results = []
    for argv in argvs:
        state.events.clear()
        losses = train(argv)
        groups = [event[2] for event in state.events if event[0] == "enter"]
        ranks = {None if group is None else tuple(dist.get_process_group_ranks(group)) for group in groups}
        results.append((losses, len(groups), ranks))
    return results


def test_te_tensor_and_sequence_parallel_match_one_process(worlds, standin):
    # GPT at tp2 with and without sequence parallelism; LLaMA (GQA groups and SwiGLU's two blocks
    # split per rank) with it.
    # LLaMA's and GPT-with-tanh-GELU's MLPs are TE's LayerNormMLP (set_parallel_mode).
    families = FAMILIES | {"gpt-tanh": FAMILIES["gpt"] + ["--openai-gelu"]}
    argvs = {family: TINY + families[family] + ["--train-iters", "3"] for family in families}
    reference = {family: train(argv) for family, argv in argvs.items()}
    # FP8 with pipeline parallelism: each stage enters fp8_autocast once per micro-batch forward,
    # its amaxes reduced over its own stage's ranks (the stand-in's autocast all-reduces over
    # fp8_group as it exits: the whole world would leave the stages waiting for each other).
    fp8 = ["--fp8-format", "hybrid"]
    reference["gpt-fp8"] = train(argvs["gpt"] + WITH_TE + fp8)
    cases = [("gpt", "tp2"), ("gpt", "tp2-sp"), ("llama", "tp2-sp"), ("gpt-tanh", "tp2-sp"), ("gpt-fp8", "pp2")]
    runs = [argvs[family] + WITH_TE + LAYOUTS[layout] for family, layout in cases[:-1]]
    runs.append(argvs["gpt"] + WITH_TE + fp8 + ["--pipeline-model-parallel-size", "2"])
    results = worlds.run(2, train_with_standin, runs)
    for rank, rank_results in enumerate(results):
        for (family, layout), (losses, fp8_forwards, amax_groups) in zip(cases, rank_results, strict=True):
            assert losses == pytest.approx(reference[family], rel=1e-5), (family, layout)
            if layout == "pp2":  # 3 steps x 2 micro-batches, one forward each on each stage
                assert (fp8_forwards, amax_groups) == (6, {(rank,)}), rank
            else:
                assert fp8_forwards == 0


# -- the real Transformer Engine on a GPU (skipped here: no GPU, no TE) --------------------------
def _real_te_and_fp8_gpu() -> str:
    """Why the real-TE tests cannot run here ("" when they can)."""
    from mega_transformer_engine.availability import Environment

    return Environment.probe().missing(fp8=True)


REAL_TE = pytest.mark.skipif(bool(_real_te_and_fp8_gpu()), reason=f"real TE on a GPU: {_real_te_and_fp8_gpu()}")
GPU_RUN = ["--mock-data", "--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "256",
           "--num-attention-heads", "4", "--seq-length", "128", "--vocab-size", "512", "--micro-batch-size", "4",
           "--global-batch-size", "8", "--lr", "1e-4", "--eval-iters", "0", "--log-interval", "100",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5", "--bf16", "--train-iters", "5"]


@REAL_TE
@pytest.mark.parametrize("family", list(FAMILIES))
def test_real_te_matches_torch_in_bf16(family):
    argv = GPU_RUN + FAMILIES[family]
    assert train(argv + ["--kernels", "transformer-engine"]) == pytest.approx(train(argv), rel=2e-2)


@REAL_TE
def test_real_te_fp8_trains_close_to_bf16():
    argv = GPU_RUN + FAMILIES["llama"] + ["--kernels", "transformer-engine"]
    fp8 = train(argv + ["--fp8-format", "hybrid", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max"])
    assert fp8 == pytest.approx(train(argv), rel=5e-2)


def test_to_tensor_parallel_keeps_this_ranks_shard_of_a_built_layer(standin):
    """A layer built on a real device (not build_stage's meta) hands its shard to the TE layer
    that replaces it, marked as mega's own parallel layers mark theirs."""
    import torch
    from mega_transformer_engine.layers import linear_factory, norm_linear_factory, norm_mlp_factory

    from mega.core.parallel.groups import Group
    from mega.core.parallel.plan import ColumnThenRow, Colwise, Rowwise

    te = sys.modules["transformer_engine.pytorch"]
    group = Group("tp", (0, 1), 1, None)  # rank 1 of 2; no communication happens here
    fc1 = norm_linear_factory(te)("RMSNorm", 4, 8, True, 1e-5)
    torch.nn.init.normal_(fc1.weight)
    torch.nn.init.normal_(fc1.layer_norm_weight)
    column = fc1.to_tensor_parallel(Colwise(chunks=2), group, sequence_parallel=True)
    assert (column.parallel_mode, column.tp_size, column.sequence_parallel) == ("column", 2, True)
    gate, up = fc1.weight.chunk(2)
    torch.testing.assert_close(column.weight, torch.cat([gate[2:], up[2:]]))  # rank 1's half of each block
    assert (column.weight.partition_dim, column.weight.partition_chunks, column.bias.partition_dim) == (0, 2, 0)
    torch.testing.assert_close(column.layer_norm_weight, fc1.layer_norm_weight)

    mlp = norm_mlp_factory(te)("LayerNorm", 4, 6, "swiglu", True, 1e-5)
    for param in mlp.parameters():
        torch.nn.init.normal_(param)
    parallel = mlp.to_tensor_parallel(ColumnThenRow(chunks=2), group, sequence_parallel=True)
    assert (parallel.set_parallel_mode, parallel.tp_size, parallel.sequence_parallel) == (True, 2, True)
    gate, up = mlp.fc1_weight.chunk(2)
    torch.testing.assert_close(parallel.fc1_weight, torch.cat([gate[3:], up[3:]]))
    torch.testing.assert_close(parallel.fc2_weight, mlp.fc2_weight[:, 3:])
    torch.testing.assert_close(parallel.fc2_bias, mlp.fc2_bias)  # added once, after the reduction
    assert (parallel.fc1_weight.partition_chunks, parallel.fc1_bias.partition_dim, parallel.fc2_weight.partition_dim) \
        == (2, 0, 1)
    assert not getattr(parallel.fc2_bias, "tensor_model_parallel", False)
    with pytest.raises(TypeError, match="split as ColumnThenRow"):
        mlp.to_tensor_parallel(Colwise(), group, sequence_parallel=False)
    with pytest.raises(ValueError, match="no activation equal to 'gelu'"):  # exact GELU: TE's is tanh
        norm_mlp_factory(te)("LayerNorm", 4, 6, "gelu", True, 1e-5)

    proj = linear_factory(te)(8, 4, True)
    torch.nn.init.normal_(proj.weight)
    row = proj.to_tensor_parallel(Rowwise(), group, sequence_parallel=False)
    torch.testing.assert_close(row.weight, proj.weight[:, 4:])
    assert row.weight.partition_dim == 1 and not getattr(row.bias, "tensor_model_parallel", False)
