"""`mega train --model-family bert` (binary head on, fp32, 5 steps on Megatron-style mock BERT
samples) computes at tp2 with sequence parallelism, pp2, and dp2 with the distributed optimizer
what one process computes: both logged losses, ``lm loss`` and ``sop loss``, agree to 1e-5
(relative) at every step. The 90-token vocabulary pads to 96 rows at tp1 and 128 at tp2; the
mixed sample lengths of the mock data put padding into every micro-batch. Megatron-LM's pre-LN
BERT (``--bert-pre-layernorm``: a final norm on the last stage, no embedding norm) does the same at
tp2 with sequence parallelism and at pp2."""

from __future__ import annotations

from mega.core.plugins import hookimpl

COMMON = [
    "--model-family", "bert", "--mock-data", "--model-preset", "tiny", "--num-layers", "4", "--hidden-size", "32",
    "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "90",
    "--make-vocab-size-divisible-by", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "5", "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "0", "--log-interval", "100",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--bert-binary-head",
]
LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2-distributed-optimizer": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
}


class StepLossListener:
    def __init__(self, steps: list):
        self.steps = steps

    @hookimpl
    def on_step_end(self, run, iteration, metrics):
        self.steps.append(dict(metrics["losses"]))


class StepLosses:
    """A plugin whose callback records the losses each step logs (``lm loss``, ``sop loss``)."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []

    @hookimpl
    def register_callbacks(self, register):
        register("bert-step-losses", lambda run_config: StepLossListener(self.steps))


def train_losses(argv: list[str]) -> list[dict[str, float]]:
    from mega.core.plugins.manager import load_plugins
    from mega.train.command import parse_run
    from mega.train.launch_run import run_training

    recorder = StepLosses()
    plugins = load_plugins(extra=[("bert-step-losses", recorder)])
    run, family = parse_run(argv, plugins)
    run_training(run, family, plugins)
    return recorder.steps


def train_each(argvs: list[list[str]]) -> list[list[dict[str, float]]]:
    return [train_losses(argv) for argv in argvs]


def assert_close(steps, reference, layout):
    assert len(steps) == len(reference) == 5, layout
    for step, (got, want) in enumerate(zip(steps, reference, strict=True)):
        assert set(got) == set(want) == {"lm loss", "sop loss"}, layout
        for name in want:
            assert abs(got[name] - want[name]) <= 1e-5 * abs(want[name]), \
                f"{layout}: step {step + 1} {name} {got[name]} != {want[name]}"


PRE_LN = ["--bert-pre-layernorm"]
PRE_LN_LAYOUTS = ("tp2-sp", "pp2")


def test_every_layout_matches_one_process(worlds):
    reference = train_losses(COMMON)
    # Each step's samples and masks are new (the mock sentences are random words, near-uniform for
    # a 5-step model), so the check that training happens is that every step computes its own losses.
    assert len({(step["lm loss"], step["sop loss"]) for step in reference}) == 5
    pre_ln_reference = train_losses(COMMON + PRE_LN)
    assert pre_ln_reference != reference
    runs = [COMMON + extra for extra in LAYOUTS.values()] + [COMMON + PRE_LN + LAYOUTS[name] for name in PRE_LN_LAYOUTS]
    results = worlds.run(2, train_each, runs)
    for index, layout in enumerate([*LAYOUTS, *(f"pre-LN {name}" for name in PRE_LN_LAYOUTS)]):
        assert results[0][index] == results[1][index], layout  # every rank logs the same losses
        assert_close(results[0][index], reference if index < len(LAYOUTS) else pre_ln_reference, layout)
