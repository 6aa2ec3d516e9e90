"""RoPE scaling kinds of Hugging Face's Llama-like decoders (linear, dynamic NTK, YaRN, llama3 with
all its parameters) through the generic bridge, against transformers, on the CPU (in-process runs
pinned there, so it passes on a GPU machine too).

For each kind a tiny random Llama, Qwen2 or Mistral with that ``rope_scaling`` is converted to mega:
its logits on a sequence longer than the original context (where the scaling matters: the same
weights without it give other logits) equal transformers' (fp32, 1e-5); ``mega generate``'s greedy
tokens (the KV cache path, the sequence growing past the original context while it decodes) equal
transformers' ``generate``; mega -> Hugging Face gives back the tensors bit for bit and the RoPE
settings as transformers reads them. A kind mega does not compute is refused naming
``rope_scaling.rope_type``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import VOCAB, save_hf_model, tiny_random_model  # noqa: E402

transformers = pytest.importorskip("transformers")

from mega.ckpt_convert import convert  # noqa: E402
from mega.ckpt_convert.errors import ConversionError  # noqa: E402

pytestmark = pytest.mark.usefixtures("cpu_only")

TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, initializer_range=0.1)
ORIGINAL = 16  # the original context of yarn and llama3; dynamic's is max_position_embeddings (32)
KINDS = {  # kind -> (class, config class, settings)
    "linear": ("LlamaForCausalLM", "LlamaConfig", dict(
        max_position_embeddings=64, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "dynamic": ("MistralForCausalLM", "MistralConfig", dict(
        max_position_embeddings=32, sliding_window=None, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "yarn": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        max_position_embeddings=64, rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0,
                                                  "original_max_position_embeddings": ORIGINAL})),
    "llama3": ("LlamaForCausalLM", "LlamaConfig", dict(
        max_position_embeddings=64, rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                                                  "high_freq_factor": 8.0,
                                                  "original_max_position_embeddings": ORIGINAL})),
}
LONG = 48  # tokens: past every kind's original context
PROMPT = "the quick brown fox jumps over the lazy dog"  # 23 tokens: past yarn's and llama3's original context
NEW_TOKENS = 24  # the prompt and these pass dynamic's, within mega's positions


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module", params=list(KINDS))
def case(request, tmp_path_factory):
    kind = request.param
    class_name, config_name, settings = KINDS[kind]
    root = tmp_path_factory.mktemp(kind)
    hf_dir = save_hf_model(tiny_random_model(class_name, config_name, {**TINY, **settings}, kind), root / "hf")
    convert(hf_dir, root / "mega", to_format="mega")
    return kind, hf_dir, root / "mega"


def fresh_hf_model(hf_dir):
    """transformers' model as saved (dynamic scaling keeps state between calls: each use its own)."""
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def test_logits_past_the_original_context_equal_transformers(case, assert_close):
    from test_hf_bridge import layout_logits

    kind, hf_dir, mega_dir = case
    ids = torch.randint(0, VOCAB, (2, LONG), generator=torch.Generator().manual_seed(1))
    hf_model = fresh_hf_model(hf_dir)
    with torch.no_grad():
        expected = hf_model(ids).logits
        plain_config = type(hf_model.config)(**{**TINY, **KINDS[kind][2], "rope_scaling": None})
        plain = type(hf_model)(plain_config).eval()
        plain.load_state_dict(hf_model.state_dict())
        unscaled = plain(ids).logits
    assert (expected - unscaled).abs().max() > 1e-3, f"{kind} scaling must change the logits for the test to count"
    logits, _ = layout_logits(str(mega_dir), ids, (1, 1))
    assert_close(logits, expected, what=kind)


def test_mega_generate_decodes_as_transformers_past_the_original_context(case, capsys):
    from mega.inference.cli.generate import main as generate_main

    kind, hf_dir, mega_dir = case
    args = ["--load", str(mega_dir), "--max-tokens", str(NEW_TOKENS), "--greedy", "--json", "--device", "cpu",
            "--prompt", PROMPT]
    assert generate_main(args) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(hf_dir).encode(PROMPT)])
    if kind == "dynamic":  # its frequencies change as the sequence grows: the decoding crosses the original
        assert ids.shape[1] < KINDS[kind][2]["max_position_embeddings"] < ids.shape[1] + NEW_TOKENS
    out = fresh_hf_model(hf_dir).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
    assert record["tokens"] == out[0, ids.shape[1]:].tolist(), kind


def test_mega_to_hugging_face_gives_back_the_weights_and_rope_settings(case, tmp_path):
    from safetensors.torch import load_file

    kind, hf_dir, mega_dir = case
    convert(mega_dir, tmp_path / "back", to_format="hf")
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original), kind
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), f"{kind} {name}"
    source, written = (transformers.AutoConfig.from_pretrained(path) for path in (hf_dir, tmp_path / "back"))
    assert type(written) is type(source)
    assert written.rope_parameters == source.rope_parameters, kind
    assert written.max_position_embeddings == source.max_position_embeddings, kind


def test_a_rope_kind_mega_does_not_compute_is_refused_by_name(tmp_path):
    head_pairs = TINY["hidden_size"] // TINY["num_attention_heads"] // 2
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * head_pairs, "long_factor": [2.0] * head_pairs,
                "original_max_position_embeddings": ORIGINAL}
    config = transformers.LlamaConfig(**TINY, max_position_embeddings=64, rope_scaling=longrope)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match="rope_scaling.rope_type 'longrope'"):
        convert(tmp_path / "hf", tmp_path / "mega", to_format="mega")
    assert not (tmp_path / "mega").exists()


@pytest.mark.parametrize("settings, named", [
    (dict(rope_type="yarn", rotary_scaling_factor=4.0), "--rope-type yarn"),
    (dict(use_rope_scaling=True, rope_high_freq_factor=8.0), "rope_high_freq_factor"),
])
def test_megatron_export_refuses_the_rope_megatron_does_not_compute(settings, named):
    from mega.ckpt_convert.megatron.args import args_for
    from mega.models.llama.config import LlamaConfig

    config = LlamaConfig(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, **settings)
    with pytest.raises(ConversionError, match=named):
        args_for(config, 1, 1, 512, 0, "torch", None)
    assert args_for(LlamaConfig(use_rope_scaling=True), 1, 1, 512, 0, "torch", None).use_rope_scaling


def test_dynamic_scaling_of_prompts_prefilled_together_is_each_prompts_own():
    """Prompts of different lengths past the original context, right-padded into one forward (the
    loop prefills prompts that want their log-probabilities together): each row's padding takes
    its last real position, so dynamic NTK's frequencies follow each prompt's own length, as
    transformers' forward over that prompt alone."""
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.inference.engine import GenerationEngine, GenerationRequest
    from mega.inference.loader import load_model

    class_name, config_name, settings = KINDS["dynamic"]
    root = Path(tempfile.mkdtemp())
    hf_dir = save_hf_model(tiny_random_model(class_name, config_name, {**TINY, **settings}, "dynamic"), root / "hf")
    convert(hf_dir, root / "mega", to_format="mega")
    loaded = load_model(root / "mega", groups=ParallelGroups(ParallelConfig()), device=torch.device("cpu"))
    engine = GenerationEngine(loaded.model, vocab_size=VOCAB, max_positions=loaded.max_positions)
    prompts = [torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(length)).tolist()
               for length in (36, 44)]  # both past the original 32 positions, by different amounts
    results = engine.generate([GenerationRequest(p, 1, logprobs=True) for p in prompts])
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            logits = fresh_hf_model(hf_dir)(torch.tensor([prompt])).logits[0, :-1]
        expected = logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        got = torch.tensor(result.logprobs[:len(prompt) - 1])
        assert torch.allclose(got, expected, atol=1e-5), (len(prompt), (got - expected).abs().max())
