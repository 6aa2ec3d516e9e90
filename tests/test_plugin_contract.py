"""The third-party author's contract (docs/plugins.md), with real distributions installed outside
the tree in one site: every kind `mega plugins new` writes (their own tests pass as generated);
the generated callback's flag and TOML table; the generated family (gpt with a ReLU MLP) at tp2
equal to one process; a plugin that fails at import and one whose callback fails lazily, named at
each point of use; a newcomer registering `gpt` again, marked where a user looks."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mega.train.scaffold.command import write_plugin
from mega.train.scaffold.templates import KINDS

TEST_PLUGINS = Path(__file__).parent / "plugins"
FAILING = ("broken", "lazy_callback", "duplicate_gpt")  # entry-point names of the misbehaving ones
NAMES = {"family": "gpt-relu", "callback": "loss-csv"}  # the rest: my-KIND
TRAIN = ["train", "--model-family", "gpt-relu", "--model-preset", "tiny", "--mock-data", "--train-iters", "3",
         "--log-interval", "1", "--eval-iters", "0", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seq-length", "32", "--lr", "1e-3", "--seed", "5"]
BROKEN = ("plugin broken (mega-broken) failed to load: ModuleNotFoundError: "
          "No module named 'mega_broken_missing_dependency'")


@pytest.fixture(scope="module")
def site(tmp_path_factory, install_plugins):
    """(environ, generated directories): everything installed with one pip call."""
    root = tmp_path_factory.mktemp("generated")
    generated = {}
    for kind in KINDS:
        name = NAMES.get(kind, f"my-{kind}")
        write_plugin(name, kind, root / name)
        generated[kind] = root / name
    environ = install_plugins(*generated.values(), *(TEST_PLUGINS / f"mega-{d}" for d in
                                                      ("broken", "lazy-callback", "duplicate-gpt", "raising-callback")))
    environ.pop("MEGA_PLUGIN_TRACEBACKS", None)
    return environ, generated


def without(environ, *plugins):
    return dict(environ, MEGA_DISABLE_PLUGINS=",".join(plugins))


def mega(environ, *args, code=0, cwd=None):
    result = subprocess.run([sys.executable, "-m", "mega.core.cli.main", *args], capture_output=True, text=True,
                            env=environ, timeout=600, cwd=cwd)
    if code is not None:
        assert result.returncode == code, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def losses(output: str) -> list[float]:
    return [float(value) for value in re.findall(r"lm loss: ([0-9.E+-]+) \|", output)]


def test_every_generated_kind_installs_and_its_test_passes(site, tmp_path):
    environ, generated = site
    tests = [str(directory / "tests") for directory in generated.values()]
    # From an empty directory, so the tests import the installed distributions, not their sources.
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                            capture_output=True, text=True, env=without(environ, *FAILING), cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    assert f"{sum(len(list((d / 'tests').glob('test_*.py'))) for d in generated.values()) + 1} passed" in result.stdout


def test_the_callback_takes_a_flag_and_a_toml_table_and_the_family_at_tp2_is_one_process(site, tmp_path):
    environ, _ = site
    # One process: --loss-csv-path, beside the failing plugins, skipped on request.
    one = mega(environ, *TRAIN, "--skip-failed-plugins",
               "--loss-csv-path", str(tmp_path / "one.csv"))
    assert f"--skip-failed-plugins: training without {BROKEN}" in one.stderr
    # tp2, the option from the [loss_csv] table of --config.
    config = tmp_path / "run.toml"
    config.write_text(f'[loss_csv]\nloss_csv_path = "{tmp_path / "tp2.csv"}"\n')
    tp2 = mega(without(environ, *FAILING), *TRAIN, "--nproc-per-node", "2", "--tensor-model-parallel-size", "2",
               "--config", str(config))
    assert len(losses(one.stdout)) == 3
    for step, (got, want) in enumerate(zip(losses(tp2.stdout), losses(one.stdout), strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step + 1}: tp2 {got} != one process {want}"
    rows = {name: list(csv.reader((tmp_path / f"{name}.csv").open())) for name in ("one", "tp2")}
    assert rows["one"][0] == ["iteration", "loss"] and [r[0] for r in rows["one"][1:]] == ["1", "2", "3"]
    assert [float(r[1]) for r in rows["one"][1:]] == pytest.approx(losses(one.stdout), rel=1e-5)
    assert [float(r[1]) for r in rows["tp2"][1:]] == pytest.approx([float(r[1]) for r in rows["one"][1:]], rel=1e-5)


# Many `mega` commands in one process (each would import torch again): {label: [argv, environ]}
# -> {label: (exit code, stdout, stderr)}.
RUNNER = """
import contextlib, io, json, os, sys
from mega.core.cli.main import main
results = {}
for label, (argv, environ) in json.loads(sys.argv[1]).items():
    os.environ.update(environ)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
    for name in environ:
        del os.environ[name]
    results[label] = (code, out.getvalue(), err.getvalue())
from mega.core.plugins import get_plugins
plugins = get_plugins()
for label, registry, name in (("tokenizer", plugins.tokenizers, "BrokenTokenizer"),
                              ("kernel backend", plugins.kernel_backends, "broken-norm"),
                              ("checkpoint format", plugins.checkpoint_formats, "broken-format")):
    try:
        registry.get(name)
    except KeyError as error:
        results[label] = (2, "", str(error))
import tempfile
from mega.ckpt_convert import open_checkpoint
try:
    open_checkpoint(tempfile.mkdtemp())
except Exception as error:
    results["checkpoint detection"] = (2, "", str(error))
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def cli(site, tmp_path_factory):
    """What a user meets with all of them installed: the broken plugin, the lazily failing
    callback and the duplicate `gpt` beside the generated ones."""
    bad_toml = tmp_path_factory.mktemp("toml") / "bad.toml"
    bad_toml.write_text("[loss_csv]\nloss_csv_pth = 'x.csv'\n")
    broken_table = bad_toml.with_name("broken.toml")
    broken_table.write_text("[broken]\npath = 'x'\n")
    commands = {
        "family": [[*TRAIN[:2], "gpt-broken"], {}],
        "command": [["broken-hello"], {}],
        "command traced": [["broken-hello"], {"MEGA_PLUGIN_TRACEBACKS": "1"}],
        "train": [TRAIN, {}],
        "plugins": [["plugins", "--traceback"], {}],
        "doctor": [["doctor"], {}],
        "train help": [["train", "--help"], {}],
        "gpt-relu help": [["train", "--model-family", "gpt-relu", "--help"], {}],
        "bad toml": [[*TRAIN, "--config", str(bad_toml)], {}],
        "broken flag": [[*TRAIN, "--broken-path", "x"], {}],
        "other flag": [[*TRAIN, "--lr-decay-styl", "x"], {}],
        "broken table": [[*TRAIN, "--config", str(broken_table)], {}],
    }
    import json

    result = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(commands)], capture_output=True, text=True,
                            env=site[0], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return {label: tuple(value) for label, value in json.loads(result.stdout.splitlines()[-1]).items()} | {
        "bad toml path": str(bad_toml), "broken table path": str(broken_table)}


def test_the_plugin_options_are_listed_and_validated_like_the_cores(cli):
    code, help_text, _ = cli["gpt-relu help"]
    assert code == 0
    assert re.search(r"plugin loss_csv \(loss-csv\):\n\s+--loss-csv-path LOSS_CSV_PATH", help_text)
    assert "--activation {gelu,gelu_tanh,relu,squared_relu,swiglu}" in help_text
    code, _, error = cli["bad toml"]
    assert code == 2
    assert f"{cli['bad toml path']}: unknown key 'loss_csv_pth' in [loss_csv]; did you mean loss_csv_path?" in error


def test_a_plugin_that_fails_to_import_is_named_at_each_point_of_use(cli):
    code, _, error = cli["family"]
    assert code == 2 and f"no model 'gpt-broken'; {BROKEN}" in error
    code, _, error = cli["command"]
    assert code == 2 and f"mega: unknown command 'broken-hello'; {BROKEN}" in error
    for kind, name in (("tokenizer", "BrokenTokenizer"), ("kernel backend", "broken-norm"),
                       ("checkpoint format", "broken-format")):
        assert cli[kind][2].startswith(f"no {kind} '{name}'; {BROKEN}"), cli[kind]
    assert f"is not a checkpoint of a known format (hf, mega, megatron, my-checkpoint-format); name it with --from; {BROKEN}" in cli["checkpoint detection"][2]
    # The traceback, on request.
    assert "Traceback" not in error and "MEGA_PLUGIN_TRACEBACKS=1 shows the traceback" in error
    traced = cli["command traced"][2]
    assert "Traceback (most recent call last)" in traced and "import mega_broken_missing_dependency" in traced
    assert "import mega_broken_missing_dependency" in cli["plugins"][1]


def test_a_callback_failing_at_import_or_lazily_stops_training_before_it_starts(cli):
    # The broken plugin may have held a callback; the lazy one's fails when imported: the same stop.
    code, out, error = cli["train"]
    assert code == 2 and "iteration" not in out
    assert f"mega train: error: a plugin cannot take part in training: {BROKEN}" in error
    assert ("callback 'lazy-csv': plugin lazy_callback (mega-lazy-callback) failed to load: ModuleNotFoundError: "
            "No module named 'mega_lazy_callback_missing_dependency'") in error
    assert "or pass --skip-failed-plugins" in error


def test_a_duplicate_family_marks_the_newcomer_and_the_rest_keeps_working(cli):
    listing = cli["plugins"][1]
    models_row = next(line for line in listing.splitlines() if line.startswith("models "))
    newcomer_row = next(line for line in listing.splitlines() if line.startswith("duplicate_gpt "))
    assert "ERROR" not in models_row and "gpt (CONTESTED)" in models_row
    assert "DUPLICATE model 'gpt' is registered twice: first by plugin 'models' (mega-models" in newcomer_row
    doctor = cli["doctor"][1]
    assert "disable the newcomer: MEGA_DISABLE_PLUGINS=duplicate_gpt (or pip uninstall mega-duplicate-gpt)" in doctor
    # gpt is the default family: the help still comes, saying why the model flags are missing.
    code, help_text, _ = cli["train help"]
    assert code == 0 and "usage: mega train" in help_text and "model 'gpt' is registered twice" in help_text
    assert "--activation" in cli["gpt-relu help"][1]


def test_the_flags_and_table_of_a_plugin_that_failed_to_load_name_it_and_help_lists_it(cli):
    """Issue 47, item 3: what a failed plugin would have added is unknown; its name says which
    flags (--broken-*) and which table ([broken]) are probably its, and --help says what is missing."""
    code, _, error = cli["broken flag"]
    assert code == 2
    assert ("mega train: error: unknown flag --broken-path; probably a flag of plugin broken (mega-broken), "
            "which failed to load: ModuleNotFoundError: No module named 'mega_broken_missing_dependency'") in error
    code, _, error = cli["other flag"]  # not its prefix: the closest flag, and the plugin whose flags are missing
    assert code == 2 and "unknown flag --lr-decay-styl; did you mean --lr-decay-style, " in error
    assert f"{BROKEN} (MEGA_PLUGIN_TRACEBACKS=1 shows the traceback) (its flags are missing; --lr-decay-styl may be one)" in error
    code, _, error = cli["broken table"]
    assert code == 2 and "did you mean" not in error
    assert (f"{cli['broken table path']}: unknown section [broken]; the table of plugin broken (mega-broken), "
            "which failed to load: ModuleNotFoundError") in error
    help_text = re.sub(r"\s+", " ", cli["gpt-relu help"][1])
    assert ("plugin broken (mega-broken 0.1.0): FAILED TO LOAD: A test plugin of tests/test_plugin_contract.py. "
            "Its flags (probably --broken-*) and its [broken] table of --config are missing, because: "
            "ModuleNotFoundError: No module named 'mega_broken_missing_dependency'.") in help_text


def test_a_callback_that_raises_mid_run_names_its_plugin_and_hook_and_keeps_the_checkpoint(site, tmp_path):
    """Issue 47, item 3: exit 4 (not 2, bad input), the plugin, callback, hook, iteration, exception
    type and message; the traceback under --save/debug and, with MEGA_PLUGIN_TRACEBACKS=1, on screen;
    the checkpoint of iteration 1 whole; the listener's own on_train_end not called after it raised."""
    from mega.core.checkpoint.directory import find_checkpoint

    save = tmp_path / "ckpt"
    environ = dict(without(site[0], *FAILING), MEGA_TEST_RAISE_AT="2", MEGA_PLUGIN_TRACEBACKS="1")
    result = mega(environ, *TRAIN, "--save", str(save), "--save-interval", "1", code=4)
    report = save / "debug" / "callback_error_rank_0.txt"
    line = ("mega train: error: plugin raising_callback (mega-raising-callback 0.1.0): callback 'raises-at-one-step' "
            "raised in on_step_end at iteration 2: ZeroDivisionError: the step counter divided by zero at 2; "
            f"traceback in {report}; the newest checkpoint (iteration 1 in {save}) is kept; "
            "fix the plugin or disable it (MEGA_DISABLE_PLUGINS=raising_callback)\nTraceback (most recent call last):")
    assert line in result.stderr
    assert 'in on_step_end\n    raise ZeroDivisionError(f"the step counter divided by zero at {iteration}")' in result.stderr
    assert "AssertionError" not in result.stderr and "iteration        1/" in result.stdout
    assert "Traceback (most recent call last)" in report.read_text() and "mega_raising_callback" in report.read_text()
    assert find_checkpoint(str(save), checksums=True)[1].iteration == 1


def test_the_printed_install_command_works_from_any_directory(site, tmp_path):
    """`mega plugins new` prints absolute paths: the command works outside the mega checkout
    (pip --dry-run, from another directory than the one the plugin was written from)."""
    written_from, elsewhere = tmp_path / "a", tmp_path / "b"
    written_from.mkdir(), elsewhere.mkdir()
    out = mega(without(site[0], *FAILING), "plugins", "new", "my-tool", "--kind", "command", cwd=written_from).stdout
    install = out.split("next: ", 1)[1].split(" && ")[0]
    assert " -c /" in install and f"-e '{written_from / 'my-tool'}[test]'" in install
    result = subprocess.run(f"{sys.executable} -m {install} --dry-run --no-deps", shell=True, cwd=elsewhere,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "Would install my-tool-0.1.0" in result.stdout, result.stderr[-3000:]
