"""Megatron-LM checkpoints against megatron-core itself: genuine torch_dist checkpoints saved by
``dist_checkpointing.save`` at tp 1 and tp 2 (a 2-rank gloo world) and legacy files of a tp 2 x pp 2
run import as exactly megatron-core's tensors (its own tp 1 view of them) at other layouts; exports
load back into megatron-core models (``dist_checkpointing.load``, strict ``load_state_dict``) with
equal tensors. One world serves the whole module; the models are tiny.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

pytest.importorskip("megatron.core")

import megatron_reference as ref  # noqa: E402

from mega.ckpt_convert import WriteOptions, convert  # noqa: E402
from mega.ckpt_convert.cli import main as convert_main  # noqa: E402
from mega.core.checkpoint import read_tensors, tensor_shapes  # noqa: E402

FAMILIES = ("llama", "gpt")  # llama: GQA, SwiGLU, RMSNorm, untied; gpt: biases, LayerNorm, learned positions, tied


@pytest.fixture(scope="module")
def made(world, tmp_path_factory):
    """Checkpoints megatron-core wrote, and megatron-core's tp 1 view of each model (the truth)."""
    root = tmp_path_factory.mktemp("megatron")
    world.run(ref.save_torch_dist, "llama", 1, str(root / "llama-tp1" / "iter_0000007"))
    truth = {"llama-tp1": world.run(ref.load_torch_dist, "llama", 1, str(root / "llama-tp1" / "iter_0000007"))[0]}
    for family in FAMILIES:
        world.run(ref.save_both, family, str(root / f"{family}-tp2" / "iter_0000007"), str(root / f"{family}-legacy"))
        truth[family] = world.run(ref.load_torch_dist, family, 1, str(root / f"{family}-tp2" / "iter_0000007"))[0]
    return root, truth


def assert_same_model(mega_dir: Path, truth: dict[str, torch.Tensor], rows: int | None = None) -> None:
    """The mega checkpoint's tensors equal ``truth`` bit for bit (the first ``rows`` vocabulary
    rows only, where a conversion through Hugging Face dropped the padding)."""
    names = list(tensor_shapes(mega_dir))
    tensors = read_tensors(mega_dir, names)
    assert set(names) <= set(truth)
    for name in names:
        vocab = name in ("embedding.word_embeddings.weight", "output_layer.weight")
        assert torch.equal(tensors[name][:rows] if vocab else tensors[name],
                           truth[name][:rows] if vocab else truth[name]), name


def assert_imports_as(source: Path, truth: dict[str, torch.Tensor], layout: tuple[int, int], tmp_path: Path) -> None:
    """The Megatron-LM checkpoint ``source`` imported at ``layout`` (tp, pp) is ``truth``."""
    output = tmp_path / "mega"
    convert(source, output, from_format="megatron", to_format="mega",
            options=WriteOptions(tensor_parallel_size=layout[0], pipeline_parallel_size=layout[1]))
    assert_same_model(output, truth)


@pytest.mark.parametrize(("checkpoint", "truth_of", "layout"), [
    ("llama-tp1", "llama-tp1", (2, 2)),  # a tp1 torch_dist checkpoint laid out for tp2 x pp2
    ("llama-tp2", "llama", (1, 1)),      # tp2 (saved by two ranks) to one process
    ("gpt-tp2", "gpt", (2, 1)),
    ("llama-legacy", "llama", (1, 1)),   # legacy tp2 x pp2 files merged
    ("gpt-legacy", "gpt", (1, 2)),
])
def test_import_gives_megatron_cores_tensors(checkpoint, truth_of, layout, made, tmp_path):
    root, truth = made
    assert_imports_as(root / checkpoint, truth[truth_of], layout, tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_dist_export_loads_in_megatron_core(family, made, world, tmp_path):
    """megatron -> mega -> megatron torch_dist at tp 2 and tp 1: megatron-core's
    dist_checkpointing.load fills its models with the tensors of the original checkpoint."""
    root, truth = made
    convert(root / f"{family}-legacy", tmp_path / "mega", from_format="megatron", to_format="mega")
    for tp in (2, 1):
        exported = tmp_path / f"tp{tp}"
        convert(tmp_path / "mega", exported, to_format="megatron",
                options=WriteOptions(tensor_parallel_size=tp, megatron_format="torch_dist", iteration=7))
        assert sorted(p.name for p in (exported / "iter_0000007").iterdir() if not p.name.startswith("__")) == \
            [".metadata", "common.pt", "metadata.json"]
        loaded = world.run(ref.load_torch_dist, family, tp, str(exported / "iter_0000007"))
        original = world.run(ref.load_torch_dist, family, tp, str(root / f"{family}-tp2" / "iter_0000007"))
        for rank in range(2):
            assert loaded[rank].keys() == original[rank].keys()
            for name, tensor in loaded[rank].items():
                assert torch.equal(tensor, original[rank][name]), (tp, rank, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_legacy_export_loads_in_megatron_core(family, made, world, tmp_path):
    """megatron torch_dist -> legacy tp2 x pp2 files: each loads into megatron-core's stage model
    with strict load_state_dict and equals the legacy files megatron-core's state dicts made;
    and legacy tp1 x pp1 loads into a whole model equal to megatron-core's own tp1 view."""
    root, truth = made
    exported = tmp_path / "legacy"
    convert(root / f"{family}-tp2", exported, from_format="megatron", to_format="megatron",
            options=WriteOptions(tensor_parallel_size=2, pipeline_parallel_size=2, megatron_format="legacy"))
    assert (exported / "latest_checkpointed_iteration.txt").read_text().strip() == "7"
    loaded = world.run(ref.load_legacy, family, 2, 2, str(exported), 7)
    for rank in range(2):
        for stage in range(2):
            original = torch.load(root / f"{family}-legacy" / "iter_0000007" / f"mp_rank_{rank:02d}_{stage:03d}" /
                                  "model_optim_rng.pt", weights_only=False)["model"]
            for name, tensor in loaded[rank][stage].items():
                assert torch.equal(tensor, original[name]), (rank, stage, name)
    single = tmp_path / "legacy-tp1"
    convert(root / f"{family}-tp2", single, from_format="megatron", to_format="megatron",
            options=WriteOptions(megatron_format="legacy"))
    (whole,) = world.run(ref.load_legacy, family, 1, 1, str(single), 7)[0]
    for name, tensor in whole.items():
        assert torch.equal(tensor, truth[family][name]), name


def test_checkpoint_info_and_hugging_face(made, tmp_path, capsys):
    """`mega checkpoint info` describes a Megatron-LM directory; megatron -> hf -> megatron keeps
    every tensor (the Hugging Face side is checked by the hf tests)."""
    from mega.train.checkpoint.info_command import main as info_main
    from mega.train.checkpoint.verify_command import main as verify_main

    root, truth = made
    assert info_main([str(root / "llama-legacy")]) == 0
    out = capsys.readouterr().out
    assert "Megatron-LM legacy" in out and "iteration:        7" in out and "tp=2, pp=2" in out
    assert info_main([str(root / "llama-legacy"), "--json"]) == 0  # the same lines, as JSON
    described = json.loads(capsys.readouterr().out)
    assert described["format"] == "megatron" and "\n".join(described["description"]) + "\n" == out
    assert verify_main([str(root / "llama-legacy")]) == 1  # says what it is, not only what it is not
    assert "holds a megatron checkpoint, not a mega one" in capsys.readouterr().err
    assert convert_main(["--from", "megatron", "--to", "hf", "--input", str(root / "llama-tp2"),
                         "--output", str(tmp_path / "hf"), "--progress", "never"]) == 0
    assert convert_main(["--to", "megatron", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "back"),
                         "--megatron-format", "torch_dist", "--progress", "never"]) == 0
    convert(tmp_path / "back", tmp_path / "mega", to_format="mega")
    assert_same_model(tmp_path / "mega", truth["llama"], rows=ref.VOCAB)


# -- bad input: one clear error each, nothing written -------------------------------------------

def _refused(capsys, tmp_path, source: Path, message: str) -> None:
    code = convert_main(["--from", "megatron", "--to", "mega", "--input", str(source), "--output",
                         str(tmp_path / "out"), "--progress", "never"])
    err = capsys.readouterr().err
    assert code == 1 and message in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


class Exploit:
    """What a malicious checkpoint pickles: unpickling it would run a shell command."""

    def __reduce__(self):
        return os.system, ("touch pwned",)


def test_a_pickled_class_outside_the_allowlist_is_refused(made, tmp_path, capsys):
    """Even with megatron-core imported in this process (it registers its own allowlist with torch)."""
    root, _ = made
    bad = tmp_path / "bad"
    shutil.copytree(root / "llama-legacy", bad)
    file = bad / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt"
    state = torch.load(file, weights_only=False)
    state["opt_param_scheduler"] = {"decay": Exploit()}
    torch.save(state, file)
    _refused(capsys, tmp_path, bad, "pickles posix.system, which mega does not unpickle")
    assert not Path("pwned").exists()


def test_a_truncated_distcp_file_is_named(made, tmp_path, capsys):
    root, _ = made
    bad = tmp_path / "bad"
    shutil.copytree(root / "llama-tp2", bad)
    file = max((bad / "iter_0000007").glob("*.distcp"), key=lambda p: p.stat().st_size)
    os.truncate(file, file.stat().st_size // 2)
    _refused(capsys, tmp_path, bad, f"{file.name} has {file.stat().st_size} bytes")


def test_args_that_contradict_the_tensors_name_both(made, tmp_path, capsys):
    root, _ = made
    bad = tmp_path / "bad"
    shutil.copytree(root / "llama-tp2", bad)
    common = bad / "iter_0000007" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].ffn_hidden_size = 128
    torch.save(state, common)
    _refused(capsys, tmp_path, bad, "ffn_hidden_size=128")


# Megatron-LM's older (non-core) GPT model: a nested state dict and other layer names.
OLD_LAYER_NAMES = {"input_layernorm.": "input_norm.", "self_attention.linear_qkv.": "self_attention.query_key_value.",
                   "self_attention.linear_proj.": "self_attention.dense.", "pre_mlp_layernorm.": "post_attention_norm.",
                   "mlp.linear_fc1.": "mlp.dense_h_to_4h.", "mlp.linear_fc2.": "mlp.dense_4h_to_h."}


def _old_model_state(state: dict) -> dict:
    language_model = {"embedding": {}, "encoder": {}}
    for key, value in state.items():
        if key.endswith("_extra_state"):
            continue
        if key.startswith("embedding."):
            language_model["embedding"].setdefault(key.split(".")[1], {})["weight"] = value
        elif key.startswith("decoder.layers."):
            number, rest = key[len("decoder.layers."):].split(".", 1)
            old = next(new + rest[len(core):] for core, new in OLD_LAYER_NAMES.items() if rest.startswith(core))
            language_model["encoder"][f"layers.{number}.{old}"] = value
        elif key.startswith("decoder.final_layernorm."):
            language_model["encoder"]["final_norm." + key.rsplit(".", 1)[1]] = value
        else:
            language_model["output_layer"] = {"weight": value}
    return {"language_model": language_model}


def test_older_megatron_lm_names_import_the_same(made, tmp_path):
    root, truth = made
    old = tmp_path / "old"
    shutil.copytree(root / "llama-legacy", old)
    for file in old.glob("iter_0000007/*/model_optim_rng.pt"):
        state = torch.load(file, weights_only=False)
        state["model"] = _old_model_state(state["model"])
        torch.save(state, file)
    convert(old, tmp_path / "mega", to_format="mega")
    assert_same_model(tmp_path / "mega", truth["llama"])


def test_mega_train_loads_a_megatron_directory(made, capsys):
    from mega.train.command import main as train_main

    root, _ = made
    flags = ["--mock-data", "--model-family", "llama", "--num-layers", "4", "--hidden-size", "64",
             "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "96", "--swiglu",
             "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-base", "10000", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--seq-length", "32", "--max-position-embeddings", "32",
             "--vocab-size", str(ref.VOCAB), "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
             "--train-iters", "1", "--eval-iters", "0", "--load", str(root / "llama-tp2")]
    assert train_main(flags) == 0
    assert "loaded megatron torch_dist (dist_checkpointing) checkpoint" in capsys.readouterr().out
    assert train_main([*flags[:-1], str(root / "gpt-legacy")]) == 2  # a GPT model: told, not loaded
    assert "does not match this model" in capsys.readouterr().err


@pytest.mark.parametrize("family", FAMILIES)
def test_interleaved_pipeline_legacy_files_import(family, made, world, tmp_path):
    """Legacy files of an interleaved pipeline (tp 2 x pp 2, two model chunks per stage: model0,
    model1) import as megatron-core's tensors of the same model."""
    root, truth = made
    legacy = tmp_path / "interleaved"
    world.run(ref.save_interleaved, family, str(legacy))
    output = tmp_path / "mega"
    convert(legacy, output, from_format="megatron", to_format="mega")
    assert_same_model(output, truth[family])


# -- optimizer state: megatron-core's own optimizer (get_megatron_optimizer) ----------------------

def _distributed_optimizer_export_loads(world, imported: Path, names: list[str], truth: dict, tmp_path: Path) -> None:
    from mega.ckpt_convert.mega_format import MegaSource

    # For a --use-distributed-optimizer run: megatron-core's DistributedOptimizer (dp 2, each rank a
    # flat range of every parameter) loads the export with the same moments and step, and the export
    # imports back to the same state.
    distributed = tmp_path / "distributed"
    assert convert_main(["--from", "mega", "--to", "megatron", "--with-optimizer", "--megatron-optimizer",
                         "distributed", "--input", str(imported), "--output", str(distributed)]) == 0
    loaded = world.run(ref.load_with_distributed_optimizer, "llama", str(distributed / "iter_0000009"))
    assert set(loaded[0][1]) | set(loaded[1][1]) == set(names)
    for step, held in loaded:
        assert step == 2
        for name, pieces in held.items():
            for start, end, tensors in pieces:
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(tensors[key], truth[name][key].flatten()[start:end]), (name, key, start)
    assert sum(end - start for _, held in loaded for pieces in held.values() for start, end, _ in pieces) == \
        sum(truth[name]["exp_avg"].numel() for name in names)
    convert(distributed, tmp_path / "distributed-back", from_format="megatron", to_format="mega",
            options=WriteOptions(with_optimizer=True))
    with MegaSource(tmp_path / "distributed-back", None) as mega:
        assert mega.optimizer_state().step == 2 and mega.optimizer_state().keys == ("exp_avg", "exp_avg_sq")
        for name in names:
            assert torch.equal(mega.get_optimizer(name, "exp_avg_sq"), truth[name]["exp_avg_sq"]), name


def _resumed_state_exports(world, imported: Path, names: list[str], tmp_path: Path, capsys) -> None:
    """mega train resumes the imported state; its state after a step exports to megatron-core."""
    from mega.ckpt_convert.mega_format import MegaSource
    from mega.train.command import main as train_main

    capsys.readouterr()
    m = ref.MODELS["llama"]
    assert train_main([
        "--mock-data", "--model-family", "llama", "--num-layers", str(m["num_layers"]), "--hidden-size", "64",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "96", "--swiglu",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-base", "10000", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--seq-length", "32", "--max-position-embeddings", "32",
        "--vocab-size", str(ref.VOCAB), "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--train-iters", "10", "--eval-iters", "0", "--load", str(imported), "--save", str(tmp_path / "resumed")]) == 0
    out = capsys.readouterr().out
    assert "weights, optimizer and run state; saved at iteration 9" in out

    # mega's own state after that step (iteration 10, Adam step 3) goes to megatron-core as well
    trained = tmp_path / "trained-megatron"
    assert convert_main(["--from", "mega", "--to", "megatron", "--with-optimizer", "--input",
                         str(tmp_path / "resumed"), "--output", str(trained)]) == 0
    loaded = world.run(ref.load_optimizer, "llama", 1, str(trained / "iter_0000010"))[0]
    assert loaded["iteration"] == 10
    # Megatron-LM's scheduler, built from the flags that match mega's run (lr 1e-3, cosine over 10
    # iterations of 4 samples, weight decay 0.01), takes the exported schedule without overrides
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    scheduler = OptimizerParamScheduler(
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]), init_lr=0.0, max_lr=1e-3, min_lr=0.0,
        lr_warmup_steps=0, lr_decay_steps=40, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=40, wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False)
    scheduler.load_state_dict(torch.load(trained / "iter_0000010" / "common.pt", weights_only=False)
                              ["opt_param_scheduler"])
    assert scheduler.num_steps == 40
    # ... and so does the export for a --use-distributed-optimizer run
    for_distributed = tmp_path / "trained-distributed"
    assert convert_main(["--from", "mega", "--to", "megatron", "--with-optimizer", "--megatron-optimizer",
                         "distributed", "--input", str(tmp_path / "resumed"), "--output", str(for_distributed)]) == 0
    common = torch.load(for_distributed / "iter_0000010" / "common.pt", weights_only=False)
    assert common["opt_param_scheduler"] == torch.load(trained / "iter_0000010" / "common.pt",
                                                       weights_only=False)["opt_param_scheduler"]
    with MegaSource(tmp_path / "resumed", None) as mega:
        for name in names:
            assert loaded[name]["step"] == 3, name
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(loaded[name][key], mega.get_optimizer(name, key)), (name, key)


def test_optimizer_state_moves_between_megatron_and_mega(made, world, tmp_path, capsys):
    """Adam state megatron-core's optimizer saved at tp 2 (torch_dist, iteration 9, two steps) imports
    into mega bit for bit under mega's names, mega train resumes from it (optimizer and iteration),
    and its export loads into megatron-core's optimizer, regular or distributed, with the same state."""
    from mega.ckpt_convert import ConversionError
    from mega.ckpt_convert.mega_format import MegaSource
    from mega.core.checkpoint import read_metadata

    source = tmp_path / "megatron"
    world.run(ref.save_with_optimizer, "llama", 2, str(source / "iter_0000009"))
    truth = world.run(ref.load_optimizer, "llama", 1, str(source / "iter_0000009"))[0]
    imported = tmp_path / "mega"
    assert convert_main(["--from", "megatron", "--to", "mega", "--with-optimizer", "--input", str(source),
                         "--output", str(imported), "--target-tensor-parallel-size", "2"]) == 0
    metadata = read_metadata(imported / "iter_0000009")
    assert (metadata.iteration, metadata.consumed_samples) == (9, 36)
    assert metadata.optimizer == {"state_keys": ["exp_avg", "exp_avg_sq"], "scalars": {"step": 2.0},
                                  "main_params": False}
    with MegaSource(imported, None) as mega:
        names = mega.names()
        assert set(names) == set(truth) - {"iteration"}
        for name in names:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(mega.get_optimizer(name, key), truth[name][key]), (name, key)

    exported = tmp_path / "back"
    assert convert_main(["--from", "mega", "--to", "megatron", "--with-optimizer", "--input", str(imported),
                         "--output", str(exported), "--target-tensor-parallel-size", "2"]) == 0
    again = world.run(ref.load_optimizer, "llama", 1, str(exported / "iter_0000009"))[0]
    assert again["iteration"] == 9
    for name in names:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(again[name][key], truth[name][key]), (name, key)

    _distributed_optimizer_export_loads(world, imported, names, truth, tmp_path)
    _resumed_state_exports(world, imported, names, tmp_path, capsys)

    for bad, problem in ((made[0] / "llama-tp2", "holds no optimizer state"),
                         (made[0] / "llama-legacy", r"optimizer param group 0 \(wd_mult 1.0\) holds 2 parameters")):
        with pytest.raises(ConversionError, match=problem):
            convert(bad, tmp_path / "refused", from_format="megatron", to_format="mega",
                    options=WriteOptions(with_optimizer=True))
    assert not (tmp_path / "refused").exists()


# -- Mixtral: megatron-core's MoE GPTModel (SequentialMLP experts) ----------------------------------

def _as_megatron_core(name: str, tensors: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> None:
    """mega's ``tensors[name]`` equals megatron-core's: a stacked expert tensor expert by expert."""
    prefix, _, part = name.rpartition("mlp.experts.")
    if prefix:
        experts = tensors[name]
        assert len(experts) == ref.MODELS["mixtral"]["num_experts"], name
        for expert, weight in enumerate(experts):
            assert torch.equal(weight, truth[f"{prefix}mlp.experts.local_experts.{expert}.{part}"]), (name, expert)
    else:
        assert torch.equal(tensors[name], truth[name]), name


def _as_expert_parallel(legacy: Path, directory: Path, ep: int) -> Path:
    """The tp 1 legacy files as Megatron-LM saves them at expert-parallel size ``ep`` (pp 1):
    ``mp_rank_00_EEE`` each with its experts numbered from 0, and the dense tensors on every rank."""
    state = torch.load(legacy / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    state["args"].expert_model_parallel_size = ep
    local = ref.MODELS["mixtral"]["num_experts"] // ep
    for expert_rank in range(ep):
        model = {}
        for key, value in state["model"].items():
            prefix, found, rest = key.partition("local_experts.")
            if found:
                expert, rest = rest.split(".", 1)
                if int(expert) // local != expert_rank:
                    continue
                key = f"{prefix}local_experts.{int(expert) % local}.{rest}"
            model[key] = value
        path = directory / "iter_0000007" / f"mp_rank_00_{expert_rank:03d}" / "model_optim_rng.pt"
        path.parent.mkdir(parents=True)
        torch.save({**state, "model": model}, path)
    (directory / "latest_checkpointed_iteration.txt").write_text("7")
    return directory


def test_mixtral_imports_and_exports_with_megatron_core(world, tmp_path):
    """A genuine megatron-core MoE GPTModel (4 experts, top 2) saved by dist_checkpointing at tp 1
    and as legacy files of its state_dict (also split as an expert-parallel 2 run saves them) imports
    into mega's mixtral bit for bit; exports
    (torch_dist and legacy) load back into megatron-core models with equal tensors; legacy files of a
    tp 2 run import, and export again at tp 2 as megatron-core's own."""
    dist, legacy = tmp_path / "moe-tp1", tmp_path / "moe-legacy"
    world.run(ref.save_moe, str(dist / "iter_0000007"), str(legacy))
    truth = world.run(ref.load_torch_dist, "mixtral", 1, str(dist / "iter_0000007"))[0]
    expert_parallel = _as_expert_parallel(legacy, tmp_path / "moe-ep2", 2)
    for source in (dist, legacy, expert_parallel):
        output = tmp_path / f"mega-{source.name}"
        convert(source, output, from_format="megatron", to_format="mega")
        names = list(tensor_shapes(output))
        assert any(name.endswith("mlp.experts.linear_fc1.weight") for name in names)
        tensors = read_tensors(output, names)
        for name in names:
            _as_megatron_core(name, tensors, truth)
    convert(tmp_path / "mega-moe-tp1", tmp_path / "out-dist", to_format="megatron",
            options=WriteOptions(megatron_format="torch_dist", iteration=7))
    loaded = world.run(ref.load_torch_dist, "mixtral", 1, str(tmp_path / "out-dist" / "iter_0000007"))[0]
    convert(tmp_path / "mega-moe-legacy", tmp_path / "out-legacy", to_format="megatron",
            options=WriteOptions(megatron_format="legacy", iteration=7))
    (whole,) = world.run(ref.load_legacy, "mixtral", 1, 1, str(tmp_path / "out-legacy"), 7)[0]
    for exported in (loaded, whole):
        assert exported.keys() == truth.keys()
        for name, tensor in exported.items():
            assert torch.equal(tensor, truth[name]), name

    # legacy files of a tp 2 run: each rank holds its half of every expert
    world.run(ref.save_moe_tp2, str(tmp_path / "moe-tp2" / "iter_0000007"), str(tmp_path / "moe-tp2-legacy"))
    truth = world.run(ref.load_torch_dist, "mixtral", 1, str(tmp_path / "moe-tp2" / "iter_0000007"))[0]
    convert(tmp_path / "moe-tp2-legacy", tmp_path / "mega-moe-tp2", from_format="megatron", to_format="mega")
    names = list(tensor_shapes(tmp_path / "mega-moe-tp2"))
    tensors = read_tensors(tmp_path / "mega-moe-tp2", names)
    for name in names:
        _as_megatron_core(name, tensors, truth)
    # and back to legacy files at tp 2: each loads into megatron-core's tp 2 model with strict
    # load_state_dict, holding what megatron-core's own files held
    convert(tmp_path / "mega-moe-tp2", tmp_path / "out-tp2-legacy", to_format="megatron",
            options=WriteOptions(tensor_parallel_size=2, megatron_format="legacy", iteration=7))
    loaded = world.run(ref.load_legacy, "mixtral", 2, 1, str(tmp_path / "out-tp2-legacy"), 7)
    for rank in range(2):
        original = torch.load(tmp_path / "moe-tp2-legacy" / "iter_0000007" / f"mp_rank_{rank:02d}" /
                              "model_optim_rng.pt", weights_only=False)["model"]
        (exported,) = loaded[rank]
        assert exported.keys() == {key for key, value in original.items() if torch.is_tensor(value)}
        for name, tensor in exported.items():
            assert torch.equal(tensor, original[name]), (rank, name)


def _global_name(name: str, stage: int, family: str) -> str:
    """mega's name of a tp 2 x pp 2 stage model's parameter (the last stage's tied output layer: the embedding)."""
    layers = ref.MODELS[family]["num_layers"] // 2
    if name.startswith("decoder.layers."):
        number, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{int(number) + stage * layers}.{rest}"
    tied = not ref.MODELS[family]["untie_embeddings_and_output_weights"]
    return "embedding.word_embeddings.weight" if tied and name == "output_layer.weight" else name


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_legacy_optimizer_state_moves_between_megatron_and_mega(bf16, world, tmp_path):
    """Legacy tp 2 x pp 2 files whose optimizer entries megatron-core's regular optimizer wrote (fp32:
    torch Adam's state dict; bf16: with its fp32 main parameters) import into mega under mega's names
    as megatron-core held them, and export back to files whose every rank's state megatron-core's
    optimizer loads as it was (the tied embedding's state on both ends of the pipeline)."""
    from mega.ckpt_convert.mega_format import MegaSource
    from mega.ckpt_convert.megatron.layout import model_layouts
    from mega.ckpt_convert.source import family_by_name

    family = "gpt"  # tied embeddings over two stages, biases and norms in the no-decay group
    source, imported, exported = tmp_path / "legacy", tmp_path / "mega", tmp_path / "back"
    truth = world.run(ref.save_legacy_with_optimizer, family, str(source), bf16)
    convert(source, imported, from_format="megatron", to_format="mega", options=WriteOptions(with_optimizer=True))
    keys = ("exp_avg", "exp_avg_sq", *(("main_param",) if bf16 else ()))
    with MegaSource(imported, None) as mega:
        layouts = model_layouts(family_by_name(family), mega.config, 2)
        assert mega.optimizer_state().step == 2 and mega.optimizer_state().iteration == 9
        for rank in range(2):
            for stage in range(2):
                for name, state in truth[rank][stage].items():
                    ours = _global_name(name, stage, family)
                    for key in keys:
                        shard = layouts[ours].split(mega.get_optimizer(ours, key), rank, 2)
                        assert torch.equal(shard, state[key].to(shard.dtype)), (rank, stage, name, key)
    convert(imported, exported, to_format="megatron",
            options=WriteOptions(tensor_parallel_size=2, pipeline_parallel_size=2, megatron_format="legacy",
                                 with_optimizer=True))
    loaded = world.run(ref.load_legacy_optimizer, family, str(exported), bf16)
    for rank in range(2):
        for stage in range(2):
            assert loaded[rank][stage].keys() == truth[rank][stage].keys()
            for name, state in truth[rank][stage].items():
                for key in (*keys, "step"):
                    assert torch.equal(loaded[rank][stage][name][key], state[key]), (rank, stage, name, key)


def test_mixtral_optimizer_state_moves_between_megatron_and_mega(world, tmp_path):
    """megatron-core's optimizer of a MoE model at ep 2 (a second optimizer for the experts, the
    chained optimizer's state under ``chained_0.``/``chained_1.``), saved as torch_dist: the import
    holds its moments for every parameter, experts included, and the export loads into
    megatron-core's optimizer of a run without expert parallelism as they were."""
    ep = 2
    source, imported, exported = tmp_path / "megatron", tmp_path / "mega", tmp_path / "back"
    world.run(ref.save_with_optimizer, "mixtral", 1, str(source / "iter_0000009"), 9, 2, ep)
    truth = world.run(ref.load_optimizer, "mixtral", 1, str(source / "iter_0000009"), ep)
    convert(source, imported, from_format="megatron", to_format="mega", options=WriteOptions(with_optimizer=True))
    convert(imported, exported, to_format="megatron", options=WriteOptions(with_optimizer=True))
    again = world.run(ref.load_optimizer, "mixtral", 1, str(exported / "iter_0000009"))[0]
    experts = ref.MODELS["mixtral"]["num_experts"]
    for name, state in again.items():
        if name == "iteration":
            continue
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if ".experts." in name and ep > 1:  # each rank held half of the experts: local_experts.{e}
                prefix, number, rest = name.partition("local_experts.")
                local, _, part = rest.partition(".")
                rank, local_number = divmod(int(local), experts // ep)
                held = truth[rank][f"{prefix}{number}{local_number}.{part}"][key]
            else:
                held = truth[0][name][key]
            assert torch.equal(state[key], held), (name, key)


def test_distributed_optimizer_buffers_import(world, tmp_path, capsys):
    """megatron-core's DistributedOptimizer over two data-parallel ranks (with --overlap-grad-reduce and
    buckets of 20,000 elements: six buckets, each padded at its end), saved with Megatron-LM's
    default dp_reshardable torch_dist sharding (flat bucket tensors) and as legacy files
    (distrib_optim.pt): every parameter's moments imported from either equal what the two ranks'
    optimizer shards held; args that contradict the buffer layout are named, nothing written."""
    from mega.ckpt_convert.mega_format import MegaSource

    source, legacy = tmp_path / "megatron", tmp_path / "legacy"
    held = world.run(ref.save_with_distributed_optimizer, "gpt", str(source / "iter_0000009"), 20000, 9, 2,
                     str(legacy))
    for saved in (source, legacy):
        imported = tmp_path / f"mega-{saved.name}"
        convert(saved, imported, from_format="megatron", to_format="mega", options=WriteOptions(with_optimizer=True))
        with MegaSource(imported, None) as mega:
            assert mega.optimizer_state().step == 2
            assert set(mega.names()) == set(held[0]) | set(held[1])
            for name in mega.names():
                for key in ("exp_avg", "exp_avg_sq"):
                    ours = mega.get_optimizer(name, key).flatten()
                    pieces = [piece for rank in held for piece in rank.get(name, [])]
                    assert sum(end - start for start, end, _ in pieces) == ours.numel(), name
                    for start, end, tensors in pieces:
                        assert torch.equal(ours[start:end], tensors[key]), (saved.name, name, key, start)
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    common = bad / "iter_0000009" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].overlap_grad_reduce, state["args"].ddp_bucket_size = True, 1000
    torch.save(state, common)
    code = convert_main(["--from", "megatron", "--to", "mega", "--with-optimizer", "--input", str(bad),
                         "--output", str(tmp_path / "out"), "--progress", "never"])
    assert code == 1 and "per_bucket_numel_unpadded says" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("family", "layout"), [
    ("gpt", (2, 1, 1, 1)), ("gpt", (1, 2, 1, 1)), ("gpt", (1, 2, 1, 2)), ("mixtral", (2, 1, 1, 1)),
    ("mixtral", (1, 1, 2, 1)), ("bert", (2, 1, 1, 1)), ("t5", (2, 1, 1, 1))],
    ids=["gpt-tp2", "gpt-pp2", "gpt-pp2-vpp2", "mixtral-tp2", "mixtral-ep2", "bert-tp2", "t5-tp2"])
def test_distributed_optimizer_buffers_import_at_tp_and_pp(family, layout, world, tmp_path):
    """The same at tp 2 (each tp rank's buffers hold its shards: merged as the model's are) and at
    pp 2 (each stage's buffers hold its layers; the tied embedding's copies on the first and last
    stage have a bucket each), from torch_dist (a data-parallel group per tp x pp rank) and from
    legacy files (distrib_optim.pt per rank file): every parameter's moments equal what the ranks'
    optimizers held. Each family's parameters in megatron-core's order; Mixtral's experts (without
    expert parallelism: in the one buffer, an expert at a time) stacked as their weights are. At ep 2
    megatron-core chains two optimizers: the dense parameters' over dp 2, each rank's own experts'
    over dp 1. An interleaved pipeline (pp 2 x vpp 2) has a buffer per model
    chunk, the later chunks' unbucketed."""
    tp, pp, ep, vpp = layout
    source, legacy = tmp_path / "megatron", tmp_path / "legacy"
    held = world.run(ref.save_with_distributed_optimizer, family, str(source / "iter_0000009"), None, 9, 2,
                     str(legacy), tp, pp, ep, vpp)
    for saved in (source, legacy):
        _assert_buffers_import(saved, tmp_path / f"mega-{saved.name}", held, layout)


def test_distributed_optimizer_buffers_import_with_expert_and_tensor_parallelism(tmp_path):
    """Four ranks, tp 2 x ep 2 (dense data-parallel over 2): each expert-parallel rank's buffers
    hold the tensor-parallel shards of its own experts, saved as the expert tensor-expert-pipeline
    group's ranks number them."""
    from mega.testing import DistributedWorld

    source = tmp_path / "megatron"
    with DistributedWorld(4, timeout_s=600) as four:
        held = four.run(ref.save_with_distributed_optimizer, "mixtral", str(source / "iter_0000009"), None, 9, 2,
                        None, 2, 1, 2)
        four.run(ref.leave)
    _assert_buffers_import(source, tmp_path / "mega", held, (2, 1, 2, 1))


def _assert_buffers_import(saved, imported, held: list[dict], layout: tuple[int, int, int, int]) -> None:
    """``saved`` imports with every parameter's moments equal to the pieces the ranks' distributed
    optimizers ``held`` (rank -> name in its model chunk -> pieces) at ``layout`` (tp, pp, ep, vpp)."""
    from mega.ckpt_convert.mega_format import MegaSource
    from mega.ckpt_convert.megatron.layout import chunk_layers, expert_shard_layout, model_layouts
    from mega.core.checkpoint import read_metadata
    from mega.core.plugins import get_plugins

    tp, pp, ep, vpp = layout
    places = chunk_layers(None, ref.MODELS["gpt"]["num_layers"], pp, vpp)
    local_experts = ref.MODELS["mixtral"]["num_experts"] // ep
    convert(saved, imported, from_format="megatron", to_format="mega", options=WriteOptions(with_optimizer=True))
    metadata = read_metadata(imported)
    family = get_plugins().models.get(metadata.model_family)
    layouts = model_layouts(family, family.config_class(**metadata.model_config), tp)
    compared = set()
    with MegaSource(imported, None) as mega:
        assert mega.optimizer_state().step == 2
        for rank, rank_held in enumerate(held):
            # dense layers: tp fastest, then dp, then pp; experts: tp, then ep (megatron-core's orders)
            tp_rank, stage, expert_rank = rank % tp, rank // (len(held) // pp), (rank // tp) % ep
            for chunk_local, pieces in rank_held.items():
                chunk, local = (int(chunk_local[5]), chunk_local[7:]) if vpp > 1 else (0, chunk_local)
                if local == "output_layer.weight" and pp > 1:
                    continue  # the last stage's copy of the tied embedding: the first stage's is carried
                number, rest = (local.split(".", 3)[2:] if local.startswith("decoder.layers.") else (None, None))
                name = local if number is None else f"decoder.layers.{int(number) + places[stage, chunk].start}.{rest}"
                prefix, _, expert_part = name.partition("mlp.experts.local_experts.")
                expert, _, part = expert_part.partition(".")
                name = f"{prefix}mlp.experts.{part}" if expert_part else name
                for key in ("exp_avg", "exp_avg_sq"):
                    if expert_part:
                        split = expert_shard_layout(name, layouts[name], mega.config).split
                        ours = split(mega.get_optimizer(name, key)[expert_rank * local_experts + int(expert)],
                                     tp_rank, tp).flatten()
                    else:
                        ours = layouts[name].split(mega.get_optimizer(name, key), tp_rank, tp).flatten()
                    assert sum(end - start for start, end, _ in pieces) == ours.numel(), name
                    for start, end, tensors in pieces:
                        assert torch.equal(ours[start:end], tensors[key]), (saved.name, name, key, start)
                compared.add(name)
        assert compared == set(mega.names())


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_legacy_optimizer_state_of_encoder_families_moves_both_ways(family, world, tmp_path):
    """BERT (binary head, pooler) and Megatron-LM's default T5 (both stacks, cross-attention, the
    output layer's bias under two names): legacy tp 2 files with megatron-core's regular optimizer
    state import as it held it, and export to files whose state megatron-core's optimizer loads
    as it was (its parameter order per family)."""
    import megatron_encoder_optimizer_reference as encoder_ref

    from mega.ckpt_convert.mega_format import MegaSource
    from mega.ckpt_convert.megatron.layout import model_layouts
    from mega.ckpt_convert.source import family_by_name

    source, imported, exported = tmp_path / "legacy", tmp_path / "mega", tmp_path / "back"
    truth = world.run(encoder_ref.save_legacy_with_optimizer, family, str(source))
    convert(source, imported, from_format="megatron", to_format="mega", options=WriteOptions(with_optimizer=True))
    with MegaSource(imported, None) as mega:
        layouts = model_layouts(family_by_name(family), mega.config, 2)
        assert mega.optimizer_state().step == 2
        for rank in range(2):
            for name, state in truth[rank].items():
                for key in ("exp_avg", "exp_avg_sq"):
                    shard = layouts[name].split(mega.get_optimizer(name, key), rank, 2)
                    assert torch.equal(shard, state[key]), (rank, name, key)
    convert(imported, exported, to_format="megatron",
            options=WriteOptions(tensor_parallel_size=2, megatron_format="legacy", with_optimizer=True))
    loaded = world.run(encoder_ref.load_legacy_optimizer, family, str(exported))
    for rank in range(2):
        assert loaded[rank].keys() == truth[rank].keys()
        for name, state in truth[rank].items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(loaded[rank][name][key], state[key]), (rank, name, key)


def _legacy_chained_optimizer_imports(world, tmp_path: Path, family: str) -> None:
    """An expert-parallel run's legacy files (ep 2, megatron-core's chained optimizer) import as its
    two ranks held them."""
    from mega.ckpt_convert.mega_format import MegaSource

    chained = tmp_path / "ep2"
    held = world.run(ref.save_legacy_moe_ep2_with_optimizer, str(chained))
    assert isinstance(torch.load(chained / "iter_0000009" / "mp_rank_00_001" / "model_optim_rng.pt",
                                 weights_only=False)["optimizer"], list)
    convert(chained, tmp_path / "ep2-mega", from_format="megatron", to_format="mega",
            options=WriteOptions(with_optimizer=True))
    local = ref.MODELS[family]["num_experts"] // 2
    with MegaSource(tmp_path / "ep2-mega", None) as mega:
        assert mega.optimizer_state().step == 2
        for rank in range(2):
            for name, state in held[rank].items():
                prefix, _, expert_part = name.partition("mlp.experts.local_experts.")
                for key in ("exp_avg", "exp_avg_sq"):
                    if expert_part:
                        expert, _, part = expert_part.partition(".")
                        ours = mega.get_optimizer(f"{prefix}mlp.experts.{part}", key)[rank * local + int(expert)]
                    else:
                        ours = mega.get_optimizer(name, key)
                    assert torch.equal(ours, state[key]), (rank, name, key)


def test_legacy_mixtral_optimizer_state_moves_both_ways(world, tmp_path):
    """A mixture of experts' legacy tp 2 x pp 2 files (one optimizer) import with the experts' state
    stacked as their weights are, and export to files whose every rank's state megatron-core's
    optimizer loads as it was; an expert-parallel run's files (ep 2: megatron-core's chained
    optimizer, a list of the dense parameters' state and the experts', each numbered on its own)
    import as its two ranks held them."""
    from mega.ckpt_convert.mega_format import MegaSource
    from mega.ckpt_convert.megatron.layout import expert_layout, model_layouts
    from mega.ckpt_convert.source import family_by_name

    family = "mixtral"
    source, imported, exported = tmp_path / "legacy", tmp_path / "mega", tmp_path / "back"
    truth = world.run(ref.save_legacy_with_optimizer, family, str(source))
    convert(source, imported, from_format="megatron", to_format="mega", options=WriteOptions(with_optimizer=True))
    with MegaSource(imported, None) as mega:
        layouts = model_layouts(family_by_name(family), mega.config, 2)
        assert mega.optimizer_state().step == 2
        for rank in range(2):
            for stage in range(2):
                for name, state in truth[rank][stage].items():
                    ours = _global_name(name, stage, family)
                    prefix, _, expert_part = ours.partition("mlp.experts.local_experts.")
                    for key in ("exp_avg", "exp_avg_sq"):
                        if expert_part:
                            expert, _, part = expert_part.partition(".")
                            stacked = f"{prefix}mlp.experts.{part}"
                            shard = expert_layout(stacked, mega.config).split(
                                mega.get_optimizer(stacked, key)[int(expert)], rank, 2)
                        else:
                            shard = layouts[ours].split(mega.get_optimizer(ours, key), rank, 2)
                        assert torch.equal(shard, state[key]), (rank, stage, name, key)
    convert(imported, exported, to_format="megatron",
            options=WriteOptions(tensor_parallel_size=2, pipeline_parallel_size=2, megatron_format="legacy",
                                 with_optimizer=True))
    loaded = world.run(ref.load_legacy_optimizer, family, str(exported))
    for rank in range(2):
        for stage in range(2):
            assert loaded[rank][stage].keys() == truth[rank][stage].keys()
            for name, state in truth[rank][stage].items():
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    assert torch.equal(loaded[rank][stage][name][key], state[key]), (rank, stage, name, key)

    _legacy_chained_optimizer_imports(world, tmp_path, family)


# -- tensors the conversion does not use (issue 37) ---------------------------------------------

def _legacy_with_output_layer(root: Path, tmp_path: Path) -> Path:
    """The legacy tp 2 x pp 2 files with an output layer in the first stage's files, which the
    model of their args (tied embeddings) does not have."""
    legacy = tmp_path / "legacy"
    shutil.copytree(root / "gpt-legacy", legacy)
    for path in legacy.glob("iter_0000007/mp_rank_*_000/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        embedding = state["model"]["embedding.word_embeddings.weight"]
        state["model"]["output_layer.weight"] = torch.randn_like(embedding)
        torch.save(state, path)
    return legacy


def _to_mega(source: Path, output: Path, *flags: str) -> int:
    return convert_main(["--from", "megatron", "--to", "mega", "--input", str(source), "--output", str(output),
                         "--progress", "never", *flags])


def _train_load_honours_allow_unused_tensors(torch_dist: Path, capsys) -> None:
    """``mega train --load`` converts a Megatron-LM directory on the fly: the same refusal, and the
    same flag to load it without the extra tensor."""
    from mega.train.command import main as train_main

    m = ref.MODELS["gpt"]
    flags = ["--mock-data", "--model-family", "gpt", "--num-layers", str(m["num_layers"]), "--hidden-size", "64",
             "--num-attention-heads", "4", "--ffn-hidden-size", str(m["ffn_hidden_size"]),
             "--seq-length", str(ref.SEQ), "--max-position-embeddings", str(ref.SEQ), "--vocab-size", str(ref.VOCAB),
             "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1",
             "--eval-iters", "0", "--load", str(torch_dist)]
    assert train_main(flags) != 0
    assert "output_layer.weight" in capsys.readouterr().err
    assert train_main([*flags, "--allow-unused-tensors"]) == 0
    out = capsys.readouterr().out
    assert "loaded megatron torch_dist" in out and "warning" in out and "output_layer.weight" in out, out


def test_extra_output_layer_is_refused_or_left_out_with_a_warning(made, world, tmp_path, capsys):
    """A tensor the conversion does not use is an error naming it, or with --allow-unused-tensors a
    warning (issue 37): megatron-core's tied GPT saved as torch_dist with an output layer besides,
    and its legacy tp 2 x pp 2 files given one."""
    root, truth = made
    torch_dist = tmp_path / "torch_dist"
    world.run(ref.save_torch_dist_with_extra_output_layer, "gpt", 2, str(torch_dist / "iter_0000007"))
    for source in (torch_dist, _legacy_with_output_layer(root, tmp_path)):
        refused = tmp_path / f"{source.name}-refused"
        assert _to_mega(source, refused) == 1
        err = capsys.readouterr().err
        assert "output_layer.weight" in err and "--allow-unused-tensors" in err, err
        assert not refused.exists()

        allowed = tmp_path / f"{source.name}-allowed"
        assert _to_mega(source, allowed, "--allow-unused-tensors") == 0
        err = capsys.readouterr().err
        assert "warning" in err and "output_layer.weight" in err and "left out" in err, err
        names = list(tensor_shapes(allowed))
        assert "output_layer.weight" not in names
        tensors = read_tensors(allowed, names)
        for name in names:  # the model itself converts as megatron-core holds it
            assert torch.equal(tensors[name], truth["gpt"][name]), name
    _train_load_honours_allow_unused_tensors(torch_dist, capsys)
