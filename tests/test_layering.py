"""The import layering (.importlinter; the picture is docs/architecture.md) holds on this tree,
and the same check, run the same way, fails on a copy of the tree with a back-import added.

import-linter reads the sources without importing them. It runs in a fresh interpreter that sees
only the source trees it is given: ``mega`` (a namespace package spread over the distributions)
is declared with exactly their ``mega`` folders, and the plugins' folders come first on the path,
so neither the installed packages nor this test's own imports leak into the graph.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".importlinter"
SOURCES = sorted(ROOT.glob("packages/*/src")) + sorted(ROOT.glob("plugins/*/src"))

RUNNER = """
import importlib.machinery, importlib.util, os, sys
sources, config = sys.argv[1:-1], sys.argv[-1]
spec = importlib.machinery.ModuleSpec("mega", None, is_package=True)
spec.submodule_search_locations = [os.path.join(s, "mega") for s in sources if os.path.isdir(os.path.join(s, "mega"))]
sys.modules["mega"] = importlib.util.module_from_spec(spec)
sys.path[:0] = sources
from importlinter.cli import lint_imports
sys.exit(lint_imports(config_filename=config, no_cache=True, no_logo=True))
"""


def lint(sources: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUNNER, *map(str, sources), str(CONFIG)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def test_every_plugin_is_a_root_package_of_the_check():
    listed = CONFIG.read_text().split("root_packages =")[1].split("\n\n")[0].split()
    plugins = {package.name for source in ROOT.glob("plugins/*/src") for package in source.iterdir()
               if (package / "__init__.py").is_file()}
    assert plugins <= set(listed), f"add {sorted(plugins - set(listed))} to .importlinter"


def test_the_tree_keeps_every_contract(tmp_path):
    result = lint(SOURCES, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " broken" in result.stdout and "0 broken" in result.stdout


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A copy of every source tree, which a test changes and puts back."""
    copy = tmp_path_factory.mktemp("tree")
    sources = []
    for source in SOURCES:
        target = copy / source.relative_to(ROOT)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        sources.append(target)
    return copy, sources


@pytest.mark.parametrize("file, back_import, contract, reported", [
    ("packages/core/src/mega/core/version.py", "import mega.models",
     "core imports no sibling package and no plugin BROKEN", "mega.core.version -> mega.models"),
    ("packages/core/src/mega/core/checkpoint/metadata.py", "from mega.core import build",
     "core's checkpoint format sits below build BROKEN", "mega.core.checkpoint.metadata -> mega.core.build"),
    # mega-train sits on core, beside models and data; nothing below it or beside it imports it.
    ("packages/core/src/mega/core/parallel/groups.py", "from mega.train import trainer",
     "core imports no sibling package and no plugin BROKEN", "mega.core.parallel.groups -> mega.train.trainer"),
    ("packages/models/src/mega/models/memory.py", "from mega.train.planning import memory_plan",
     "models and data import only core BROKEN", "mega.models.memory -> mega.train.planning.memory_plan"),
    ("packages/data/src/mega/data/plugin.py", "import mega.train.config",
     "models and data import only core BROKEN", "mega.data.plugin -> mega.train.config"),
    ("packages/ckpt-convert/src/mega/ckpt_convert/plugin.py", "import mega.train.checkpoint.checkpointer",
     "ckpt-convert and inference import neither train nor the test support BROKEN",
     "mega.ckpt_convert.plugin -> mega.train.checkpoint.checkpointer"),
    ("packages/inference/src/mega/inference/plugin.py", "import mega.train.launch",
     "ckpt-convert and inference import neither train nor the test support BROKEN",
     "mega.inference.plugin -> mega.train.launch"),
    ("packages/train/src/mega/train/trainer.py", "import mega.models.gpt",
     "train imports only core (families, data and kernels come through the plugin", "mega.train.trainer -> mega.models.gpt"),
    ("plugins/torchao/src/mega_torchao/fp8.py", "import mega.train.run_config",
     "plugins import only the public modules of core and models BROKEN", "mega_torchao.fp8 -> mega.train.run_config"),
    ("packages/core/src/mega/core/build.py", "import mega.testing.tiny_lm",
     "core imports no sibling package and no plugin BROKEN", "mega.core.build -> mega.testing.tiny_lm"),
    ("packages/models/src/mega/models/plugin.py", "import mega.train.testing.training_runs",
     "no package imports mega-train's test support BROKEN", "mega.models.plugin -> mega.train.testing.training_runs"),
    ("packages/data/src/mega/data/indexed_dataset.py", "import mega.data.preprocess",
     "no import loop between the modules and sub-packages of a package BROKEN", "No cycles are allowed in mega.data."),
    ("packages/inference/src/mega/inference/http/chat_api.py", "import mega.inference.http.openai_api",
     "the HTTP routers do not import each other BROKEN", "mega.inference.http.chat_api -> mega.inference.http.openai_api"),
    ("packages/inference/src/mega/inference/engine/worker.py", "import mega.inference.http.guards",
     "inference by role: the commands above the HTTP layer above the engine BROKEN",
     "mega.inference.engine.worker -> mega.inference.http.guards"),
    ("packages/models/src/mega/models/blocks/attention.py", "import mega.models.llama.config",
     "the shared blocks know no model family BROKEN", "mega.models.blocks.attention -> mega.models.llama.config"),
    ("plugins/apex/src/mega_apex/plugin.py", "import mega.inference",
     "plugins import only the public modules of core and models BROKEN", "mega_apex.plugin -> mega.inference"),
])
def test_a_back_import_breaks_its_contract(tree_copy, tmp_path, file, back_import, contract, reported):
    copy, sources = tree_copy
    original = (copy / file).read_text()
    (copy / file).write_text(original + f"\n{back_import}  # the back-import this test adds\n")
    try:
        result = lint(sources, tmp_path)
    finally:
        (copy / file).write_text(original)
    assert result.returncode != 0
    assert contract in result.stdout, result.stdout
    assert reported in result.stdout, result.stdout


# Why an import may sit inside a function instead of at the top of its module.
REASONS = ("start-up cost", "optional dependency")


def unexplained_function_imports(source: Path) -> list[str]:
    """``file:line`` of every import inside a function of ``source`` that does not say, in a
    comment on its line or right above it, which reason of :data:`REASONS` it has."""
    found = []
    for path in sorted(source.rglob("*.py")):
        lines = path.read_text().splitlines()
        for function in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and not _explained(lines, node.lineno - 1):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return sorted(set(found))


def _explained(lines: list[str], index: int) -> bool:
    """The import's own line, or the comment over the block of imports it belongs to (blank lines
    between its groups included), names a reason."""
    while index >= 0:
        line = lines[index].strip().lower()
        if any(reason in line for reason in REASONS):
            return True
        if line and not line.startswith(("import ", "from ", "#")):
            return False
        index -= 1
    return False


@pytest.mark.parametrize("source", SOURCES, ids=lambda path: str(path.relative_to(ROOT)))
def test_imports_sit_at_the_top_of_modules_unless_a_comment_says_why(source):
    assert unexplained_function_imports(source) == []


def test_no_function_of_the_converter_is_over_60_lines():
    """CPU. The converter's long constructors stay split (a check of what is refused, a layout build)."""
    long = []
    for path in sorted((ROOT / "packages/ckpt-convert/src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert long == []
