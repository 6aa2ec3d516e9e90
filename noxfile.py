"""Sessions: ``tests`` (default), ``lint`` (ruff and the import layering), ``demo``, ``bench`` and ``gpu``.

Every session installs into a fresh virtual environment with PIP_CONSTRAINT pointing at
constraints.txt, so torch is always the pinned CPU build and never an unpinned CUDA download.
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ROOT / "constraints.txt"
# Order matters only for readability: pip resolves the local siblings together.
PACKAGES = ["packages/core", "packages/train", "packages/models", "packages/data", "packages/ckpt-convert",
            "packages/inference", "packages/rl", "packages/testing"]
PLUGINS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "plugins").glob("*/pyproject.toml"))
PLUGINS = [str(Path(p).parent) for p in PLUGINS]

nox.options.sessions = ["tests", "lint"]
# Openings in the style of the pydoc topics the demo model is trained on.
DEMO_PROMPTS = ["The \"for\" statement is used to", "A class definition"]
# The demo GPT's flags (mega.train.default_run.MODEL_FLAGS) and the question its LoRA step
# answers, in the chat set's turns (mega.data.embedded_chat.prompt).
DEMO_MODEL = ["--model-family", "gpt", "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
              "--seq-length", "128", "--hidden-dropout", "0", "--attention-dropout", "0"]
DEMO_QUESTION = "<|user|>Tell me about The \"for\" statement.\n<|assistant|>"
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False


def install_mega(session: nox.Session, extra: str = "") -> None:
    """Install every package (and plugin) of the repo, with ``extra`` (e.g. ``[test]``)."""
    session.env["PIP_CONSTRAINT"] = str(CONSTRAINTS)
    session.env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # The packages' test extras name their siblings (mega-core[test] needs mega-testing, which needs
    # mega-core): the pip a fresh venv bundles (23.2) finds no candidate for a sibling asked for through
    # an extra even when its directory is on the same command line; pip 24 resolves it.
    session.install("pip>=24.1")
    session.install("torch==2.13.0")
    session.install(*[f"./{path}{extra}" for path in PACKAGES + PLUGINS])


@nox.session
def tests(session: nox.Session) -> None:
    """Install all packages with their test extras and run pytest over all of them."""
    install_mega(session, "[test]")
    # pytest exits 5 when it collected nothing; nox treats every non-zero code as a failure,
    # which is what we want: a suite that runs no test is broken, not green.
    # The slowest tests in every CI log: the suite's time budget (15 minutes on 2 cores) is kept by them.
    # Two pytest-xdist workers, one per core: each test process runs one intra-op thread (conftest.py),
    # so a single-process test leaves the other core idle. A file's tests stay on one worker
    # (--dist loadfile), so each module still starts its gloo worlds once.
    session.run("python", "-m", "pytest", "-n", "2", "--dist", "loadfile", "--durations=30", *session.posargs,
                env={"HF_HUB_OFFLINE": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, then the import layering of .importlinter (docs/architecture.md). import-linter reads
    the installed packages' sources without importing them, so they go in without dependencies."""
    session.install("ruff", "import-linter>=2.17")
    session.run("ruff", "check", ".")
    session.install("--no-deps", *[f"./{path}" for path in PACKAGES + PLUGINS])
    session.run("lint-imports")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job on the embedded default: train a small GPT on the CPU (`mega train`, no
    arguments; it saves to checkpoints/pydoc-gpt), then generate from it (`mega generate`); then
    fine-tune it with LoRA on a chat set of the same corpus and answer a question with the adapter."""
    install_mega(session)
    session.run("mega", "plugins")
    session.run("mega", "train")
    session.run("mega", "checkpoint", "info", "checkpoints/pydoc-gpt")
    for prompt in DEMO_PROMPTS:
        session.run("mega", "generate", "--load", "checkpoints/pydoc-gpt", "--prompt", prompt,
                    "--max-tokens", "60", "--temperature", "0.7", "--top-k", "40", "--seed", "1234", "--echo")
    # Second step: LoRA adapters fine-tuned on questions about the same topics (packed chat rows, the
    # answers alone in the loss; mega.train.default_run.LORA_ARGV), then one question answered
    # with the adapters merged at load.
    session.run("mega", "train", "--sft", "--dataset", "pydoc-chat", "--packed-sequences", "--split", "100,0,0",
                *DEMO_MODEL, "--load", "checkpoints/pydoc-gpt", "--finetune", "--lora-rank", "16",
                "--lora-alpha", "32", "--micro-batch-size", "16", "--train-iters", "40", "--lr", "3e-3",
                "--lr-warmup-iters", "5", "--lr-decay-style", "cosine", "--calculate-per-token-loss",
                "--eval-iters", "0", "--log-interval", "10", "--seed", "1234", "--save", "checkpoints/pydoc-gpt-lora")
    session.run("mega", "generate", "--load", "checkpoints/pydoc-gpt", "--adapter", "checkpoints/pydoc-gpt-lora",
                "--prompt", DEMO_QUESTION, "--greedy", "--max-tokens", "40", "--echo")


@nox.session
def bench(session: nox.Session) -> None:
    """Run the benchmarks under benchmarks/ (pass names to run only some)."""
    install_mega(session, "[test]")
    session.run("python", "benchmarks/run.py", *session.posargs)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """Every GPU row of docs/benchmarks.md (benchmarks/gpu_suite.py), in the current Python: on a lent
    GPU machine, which has no index, install mega from benchmarks/gpu_wheelhouse.sh's folder first.
    ``nox -s gpu -- --dry-run`` checks every row's flags on any machine."""
    session.run("python", "benchmarks/gpu_suite.py", *session.posargs)
