"""Adapters are first-class (issue 53 item 5), through the real commands: a `mega train --lora-rank`
run's checkpoint records its LoRA settings, trainable parameters and base (path, iteration,
fingerprint), which `mega checkpoint info` shows; `mega generate --load ADAPTER_DIR` alone gives
what `--load BASE --adapter DIR` and the `mega lora merge`d checkpoint give, and says how to load
it when the base is gone or changed; `mega serve --adapter` answers under the adapter's name (or
`--served-model-name`) and lists the base as its parent. CPU only (`--device cpu`), one process."""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil

import pytest

from mega.core.checkpoint import read_metadata, tensor_shapes
from mega.core.checkpoint.adapter_record import weights_fingerprint
from mega.core.cli.main import main as mega

MODEL = ["--model-family", "llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--ffn-hidden-size", "64", "--seq-length", "32", "--max-position-embeddings", "32",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
RUN = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "0", "--log-interval", "1"]
# No architecture flag: the LoRA run takes its model from the base checkpoint.
LORA = ["--finetune", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "5e-2", "--lr-decay-style", "constant",
        "--train-iters", "3", *RUN]
PROMPT = "5 17 3 99 42"


def run(*args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert mega(list(args)) == 0
    return out.getvalue()


def train_base(save, seed: int = 1234) -> None:
    run("train", *MODEL, *RUN, "--train-iters", "1", "--seed", str(seed), "--save", str(save))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    directory = tmp_path_factory.mktemp("adapters")
    base, lora = directory / "base", directory / "my-finetune"
    train_base(base)
    run("train", "--load", str(base), *LORA, "--save", str(lora))
    return base, lora


def generated(load, *extra) -> dict:
    [line] = run("generate", "--load", str(load), *extra, "--prompt", PROMPT, "--greedy", "--max-tokens", "6",
                 "--json", "--logprobs", "--device", "cpu", "--no-static-kv-cache").strip().splitlines()[-1:]
    return json.loads(line)


def test_an_adapter_checkpoint_records_its_settings_and_base(checkpoints):
    base, lora = checkpoints
    adapter = read_metadata(lora).adapter
    shapes = tensor_shapes(lora)
    assert all(".adapter." in name for name in shapes)  # adapters alone
    assert adapter["method"] == "lora" and (adapter["rank"], adapter["alpha"], adapter["dropout"]) == (4, 8.0, 0.0)
    assert adapter["targets"] == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]
    assert adapter["trainable_parameters"] == sum(math.prod(shape) for shape, _ in shapes.values()) == 3584
    base_metadata = read_metadata(base)
    assert adapter["base"] == {"path": str((base / "iter_0000001").resolve()), "iteration": 1,
                               "fingerprint": weights_fingerprint(base_metadata)}
    assert adapter["base"]["fingerprint"].startswith("sha256:")
    info = run("checkpoint", "info", str(lora))
    assert "adapter:          LORA rank=4, alpha=8.0, dropout=0.0" in info
    assert "adapter targets:  linear_fc1, linear_fc2, linear_proj, linear_qkv" in info
    assert "trainable params: 3,584" in info
    assert f"base:             {adapter['base']['path']} (found, its weights unchanged)" in info
    assert f"parameters:       {base_metadata.num_parameters:,} (the base model's)" in info


def test_load_of_an_adapter_alone_is_the_base_with_it_merged(checkpoints, tmp_path):
    base, lora = checkpoints
    alone = generated(lora)
    assert alone == generated(base, "--adapter", str(lora))
    run("lora", "merge", "--load", str(base), "--load-adapter", str(lora), "--save", str(tmp_path / "merged"))
    merged = generated(tmp_path / "merged")
    assert alone["tokens"] == merged["tokens"]
    assert alone["logprobs"] == pytest.approx(merged["logprobs"], abs=1e-5)
    assert alone["logprobs"] != pytest.approx(generated(base)["logprobs"], abs=1e-3)  # the adapters did train


def test_serve_names_the_adapter_and_lists_its_base(checkpoints, monkeypatch):
    import uvicorn
    from fastapi.testclient import TestClient

    base, lora = checkpoints
    expected = generated(lora)["text"]
    answers = {}

    def serve_requests(app, **_):
        with TestClient(app) as client:
            answers["models"] = client.get("/v1/models").json()["data"]
            name = answers["models"][0]["id"]
            answers["completion"] = client.post("/v1/completions", json={
                "model": name, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}).json()
            answers["base"] = client.post("/v1/completions", json={"model": "base", "prompt": PROMPT}).status_code

    monkeypatch.setattr(uvicorn, "run", serve_requests)
    serve = ["serve", "--device", "cpu", "--no-static-kv-cache"]
    for load, name in [(["--load", str(base), "--adapter", str(lora)], "my-finetune"),
                       (["--load", str(lora)], "my-finetune"),  # the recorded base: base/iter_0000001
                       (["--load", str(base), "--adapter", str(lora), "--served-model-name", "support-bot"],
                        "support-bot")]:
        answers.clear()
        assert mega(serve + load) == 0
        [card] = answers["models"]
        assert (card["id"], card["parent"]) == (name, "base")
        assert answers["completion"]["model"] == name
        assert answers["completion"]["choices"][0]["text"] == expected  # what mega generate --load ADAPTER gives
        assert answers["base"] == 404  # the base is not served: the adapters are merged into it


def test_a_missing_or_changed_base_is_said_with_the_command_that_works(tmp_path, capsys):
    base, lora = tmp_path / "base", tmp_path / "lora"
    train_base(base)
    run("train", "--load", str(base), *LORA, "--save", str(lora))
    shutil.move(base, tmp_path / "elsewhere")
    with pytest.raises(SystemExit) as stop:
        generated(lora)
    message = str(stop.value)
    assert f"--load {lora} holds LoRA adapters alone" in message and "is not there" in message
    assert f"--load BASE --adapter {lora}" in message
    capsys.readouterr()
    assert generated(tmp_path / "elsewhere", "--adapter", str(lora))["tokens"]  # what the message says works
    assert "note:" not in capsys.readouterr().err  # the same weights
    train_base(base, seed=7)  # another model where the base was
    with pytest.raises(SystemExit, match="holds other weights than the adapters were trained on"):
        generated(lora)
    generated(base, "--adapter", str(lora))
    assert f"note: --adapter {lora} was trained on {base.resolve()}/iter_0000001; --load {base} has other" \
        in capsys.readouterr().err
    assert "(found" not in run("checkpoint", "info", str(lora))


def test_serve_lora_modules_beside_the_base_and_refuse_another_base(checkpoints, monkeypatch, tmp_path):
    """`mega serve --load BASE --lora-modules NAME=DIR`: the adapter's requests get what `mega
    generate --load ADAPTER` (merged) gives, the base's what the base gives; an adapter whose
    recorded base fingerprint is not the served base's is refused naming both."""
    import uvicorn
    from fastapi.testclient import TestClient

    base, lora = checkpoints
    answers = {}

    def serve_requests(app, **_):
        with TestClient(app) as client:
            answers["models"] = [(m["id"], m["parent"]) for m in client.get("/v1/models").json()["data"]]
            for model in ("base", "ft"):
                answers[model] = client.post("/v1/completions", json={
                    "model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}).json()["choices"][0]["text"]

    monkeypatch.setattr(uvicorn, "run", serve_requests)
    assert mega(["serve", "--device", "cpu", "--load", str(base), "--lora-modules", f"ft={lora}"]) == 0
    assert answers["models"] == [("base", None), ("ft", "base")]
    assert answers["ft"] == generated(lora)["text"]
    assert answers["base"] == generated(base)["text"]

    run("lora", "merge", "--load", str(base), "--load-adapter", str(lora), "--save", str(tmp_path / "merged"))
    with pytest.raises(SystemExit) as stop:
        mega(["serve", "--device", "cpu", "--load", str(tmp_path / "merged"), "--lora-modules", f"ft={lora}"])
    message = str(stop.value)
    assert f"--lora-modules ft={lora}: {lora} was trained on {(base / 'iter_0000001').resolve()}" in message
    assert f"not on the served base {tmp_path / 'merged'}" in message
