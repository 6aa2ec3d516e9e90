"""The embedded default: the pydoc-topics corpus is prepared once, atomically, and trains."""

from __future__ import annotations

from mega.train.command import main, parse_run
from mega.train.default_run import DEFAULT_ARGV, LORA_ARGV
from mega.train.run_config import derive


def test_default_argv_is_a_valid_run():
    run, family = parse_run(DEFAULT_ARGV)
    run, derived = derive(run, world_size=1)
    assert family.name == "gpt" and run.data.dataset == "pydoc-topics" and derived.num_microbatches == 1
    run, family = parse_run(LORA_ARGV)
    run, _ = derive(run, world_size=1)
    assert family.name == "gpt" and run.data.dataset == "pydoc-chat" and run.plugins["models"].lora_rank == 16


def test_corpus_prepares_once_and_trains(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MEGA_CACHE_DIR", str(cache))
    argv = ["--dataset", "pydoc-topics", "--split", "95,5,0", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "2", "--seq-length", "128", "--micro-batch-size", "4", "--train-iters", "3",
            "--eval-interval", "3", "--eval-iters", "1", "--log-interval", "1", "--lr", "1e-3"]
    assert main(argv + ["--save", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "preparing the embedded corpus" in out
    losses = [float(line.split("lm loss: ")[1].split(" ")[0]) for line in out.splitlines() if "lm loss: " in line]
    assert len(losses) == 3

    # The checkpoint carries the tokenizer the corpus was made with.
    from mega.core.checkpoint import load_tokenizer
    from mega.data.embedded_corpus import VOCAB_SIZE

    tokenizer = load_tokenizer(tmp_path / "ckpt")
    assert tokenizer.vocab_size == VOCAB_SIZE
    assert tokenizer.detokenize(tokenizer.tokenize("for x in range(3): pass")) == "for x in range(3): pass"

    (directory,) = cache.iterdir()  # one complete directory; no staging leftovers
    assert sorted(p.name for p in directory.iterdir()) == [
        "cache", "corpus.jsonl", "pydoc_text_document.bin", "pydoc_text_document.idx", "tokenizer.json"]

    # The demo's LoRA step on the saved model (CPU): the chat set is made from the same corpus and
    # tokenizer, the adapters train, and generation with them answers (mega.train.default_run).
    model = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2"]
    lora = [*LORA_ARGV, *model, "--train-iters", "3", "--lr-warmup-iters", "0", "--micro-batch-size", "4", "--log-interval", "1",
            "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "lora")]
    assert main(lora) == 0
    out = capsys.readouterr().out
    assert "preparing the embedded chat set" in out and "preparing the embedded corpus" not in out
    assert len([line for line in out.splitlines() if "lm loss: " in line]) == 3
    from mega.core.cli.main import main as mega
    from mega.data.embedded_chat import prompt

    assert mega(["generate", "--load", str(tmp_path / "ckpt"), "--adapter", str(tmp_path / "lora"), "--greedy",
                 "--prompt", prompt("Tell me about The \"for\" statement."), "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()


def test_tokenizer_vocabulary_sets_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGA_CACHE_DIR", str(tmp_path))
    from mega.core.datasets import DatasetRequest
    from mega.data.embedded_corpus import VOCAB_SIZE, pydoc_topics_datasets

    data = pydoc_topics_datasets(DatasetRequest(
        data_path=None, split="95,5,0", seq_length=32, seed=1, num_samples=(10, 2, 0), cache_path=None,
        tokenizer=None, vocab_size=0))
    assert data.tokenizer.vocab_size == VOCAB_SIZE
    sample = data.train[0]
    assert len(sample["tokens"]) == 32 and max(sample["tokens"]) < VOCAB_SIZE
    text = data.tokenizer.detokenize(list(sample["tokens"]))
    assert text.isprintable() or "\n" in text


def test_the_demo_session_runs_the_declared_lora_step():
    """noxfile's demo spells mega.train.default_run.LORA_ARGV (and MODEL_FLAGS) out."""
    import ast
    from pathlib import Path

    from mega.train.default_run import MODEL_FLAGS

    tree = ast.parse((Path(__file__).resolve().parents[1] / "noxfile.py").read_text())
    constants = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                 and node.targets[0].id.startswith("DEMO_")}
    assert constants["DEMO_MODEL"] == MODEL_FLAGS
    from mega.data.embedded_chat import prompt

    assert constants["DEMO_QUESTION"] == prompt('Tell me about The "for" statement.')  # a question of the chat set
    runs = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "run"]
    lora = [run for run in runs if any(isinstance(a, ast.Constant) and a.value == "pydoc-chat" for a in run.args)]
    (run,) = lora
    argv = []
    for arg in run.args[2:]:  # after "mega", "train"
        argv += constants[arg.value.id] if isinstance(arg, ast.Starred) else [ast.literal_eval(arg)]
    assert argv == LORA_ARGV
