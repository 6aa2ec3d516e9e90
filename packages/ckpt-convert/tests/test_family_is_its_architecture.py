"""A family is its architecture (issue 53, item 1): every decoder family trained from scratch with
``--model-family F --mock-data`` and size flags alone exports to its Hugging Face class, whose
logits in transformers equal mega's (fp32, 1e-5), and ``mega train --model-family F --help`` shows
the family's defaults. CPU only (one process, fp32), so it passes on a GPU machine as well."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import VOCAB, hf_logits, input_ids  # noqa: E402
from test_trained_in_mega import mega_logits  # noqa: E402

pytest.importorskip("transformers")

from mega.ckpt_convert.cli import main as convert_main  # noqa: E402
from mega.train.command import main as train_main  # noqa: E402

SIZES = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", str(VOCAB)]
# Multi-latent attention's own sizes (its defaults are DeepSeek-V3's 512-rank latent).
MLA_SIZES = ["--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "8"]
RUN = ["--mock-data", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-2", "--eval-iters", "0",
       "--log-interval", "1000"]
ARCHITECTURES = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3-moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "deepseek-v3": "DeepseekV3ForCausalLM"}


@pytest.mark.parametrize("family", ARCHITECTURES)
def test_a_family_trained_with_size_flags_alone_exports_to_its_hugging_face_class(family, tmp_path, assert_close):
    save, output = tmp_path / "save", tmp_path / "hf"
    sizes = SIZES + (MLA_SIZES if family == "deepseek-v3" else [])
    assert train_main(["--model-family", family, *sizes, *RUN, "--save", str(save)]) == 0
    assert convert_main(["--from", "mega", "--to", "hf", "--input", str(save), "--output", str(output)]) == 0
    assert json.loads((output / "config.json").read_text())["architectures"] == [ARCHITECTURES[family]]
    ids = input_ids()
    assert_close(hf_logits(output, ids), mega_logits(save, ids), what=f"{family} logits")


def test_help_shows_the_family_defaults():
    def help_of(family: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            train_main(["--model-family", family, "--help"])
        return " ".join(out.getvalue().split())

    llama, gpt = help_of("llama"), help_of("gpt")
    assert "LayerNorm or RMSNorm (default: RMSNorm)" in llama and "(default: LayerNorm)" in gpt
    assert "learned_absolute or rope (default: rope)" in llama and "RoPE theta (default: 500000.0)" in llama
    assert "[default here: add_bias_linear=False]" in llama and "--add-bias-linear" in llama
    assert "[default here: qk_layernorm=True]" in help_of("qwen3")
