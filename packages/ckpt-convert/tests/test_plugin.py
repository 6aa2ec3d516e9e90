"""What the package registers, that listing it imports no torch, and ``open_checkpoint``: the
model source the inference server reads Hugging Face directories and mega checkpoints through."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mega.core.plugins import get_plugins


def test_registers_formats_and_the_command_without_importing_torch():
    plugins = get_plugins()
    assert {"hf", "mega"} <= set(plugins.checkpoint_formats.names())
    assert "convert" in plugins.commands.names()
    code = "import sys, mega.ckpt_convert.plugin, mega.ckpt_convert; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    help_text = subprocess.run([sys.executable, "-m", "mega.core.cli.main", "convert", "--help"], check=True,
                               capture_output=True, text=True).stdout
    for flag in ("--from", "--to", "--model-family", "--target-tensor-parallel-size",
                 "--target-pipeline-parallel-size", "--dtype", "--max-shard-size"):
        assert flag in help_text


def test_open_checkpoint_reads_either_format(hf_dirs, tmp_path):
    pytest.importorskip("transformers")
    from mega.ckpt_convert import WriteOptions, convert, open_checkpoint

    hf_dir, mega_dir = hf_dirs["gpt2-untied"], tmp_path / "mega"
    convert(hf_dir, mega_dir, to_format="mega", options=WriteOptions(tensor_parallel_size=2))
    with open_checkpoint(hf_dir) as hf, open_checkpoint(mega_dir) as mega:
        assert hf.family == mega.family == "gpt"
        assert hf.config == mega.config and hf.config.vocab_size == 300
        assert hf.tokenizer.type == mega.tokenizer.type == "HuggingFaceTokenizer"
        for source in (hf, mega):
            assert Path(source.tokenizer.options.tokenizer_model).is_absolute()
        assert sorted(hf.names()) == sorted(mega.names())
        name = "embedding.word_embeddings.weight"
        assert hf.shape(name) == (300, 64) and mega.shape(name) == (512, 64)  # padded for tp 2
        assert torch.equal(mega.get(name)[:300], hf.get(name)) and not mega.get(name)[300:].any()
        qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
        assert hf.dtype(qkv) == torch.float32 and torch.equal(hf.get(qkv), mega.get(qkv))


def test_progress_line_names_the_layer():
    import io

    from mega.ckpt_convert.progress import Progress

    stream = io.StringIO()
    progress = Progress(total_bytes=4 * 2**30, num_layers=2, enabled=True, stream=stream, interval=0)
    progress.advance("embedding.word_embeddings.weight", 2**30)
    progress.advance("decoder.layers.1.mlp.linear_fc1.weight", 2**30)
    progress.close()
    drawn = stream.getvalue().split("\r")
    assert drawn[1].startswith("embedding.word_embeddings.weight | 1.00/4.00 GiB 25% | ")
    assert drawn[2].startswith("layer 2/2 | 2.00/4.00 GiB 50% | ")
    assert drawn[-1] == "\x1b[K"  # the line is cleared at the end
