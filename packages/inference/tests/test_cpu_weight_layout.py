"""CPU (tiny_models builds every model there, whatever the machine). The CPU engines of ``mega generate`` and ``mega serve`` hold their linear weights
column-major (:mod:`mega.inference.engine.cpu_weight_layout`): the same parameter objects, shapes
and values (a tied output layer still the embedding's), only the strides; a GPT-2 (tied) and a
LLaMA (untied) so re-laid generate Hugging Face's greedy tokens and its logits (fp32). No default
device is set: one left set at import is a torch-function mode under which dynamo breaks other
modules' compiled graphs."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import POSITIONS, hf_tiny, mega_from_hf  # noqa: E402

from mega.inference.engine import GenerationEngine, GenerationRequest  # noqa: E402
from mega.inference.engine.cpu_weight_layout import hold_linear_weights_column_major  # noqa: E402


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_column_major_weights_compute_what_hugging_face_does(family):
    hf = hf_tiny(family)
    model, config = mega_from_hf(hf, "gpt" if family == "gpt2" else "llama")
    params = dict(model.named_parameters())
    values = {name: param.detach().clone() for name, param in params.items()}
    count = hold_linear_weights_column_major(model)
    assert count == 4 * config.num_layers + 1  # qkv, proj, fc1, fc2 per layer, the output layer (tied or not)
    for name, param in model.named_parameters():
        assert param is params[name] and torch.equal(param, values[name]), name
        if param.dim() == 2 and ("linear" in name or "output_layer" in name):
            assert param.t().is_contiguous() and not param.is_contiguous(), name
    if family == "gpt2":  # tied: the output layer's weight is the word embedding's, re-laid once
        assert model.output_layer.weight is model.embedding.word_embeddings.weight
    prompt = [5, 17, 42, 8, 99, 3, 1]
    engine = GenerationEngine(model, vocab_size=config.vocab_size, max_positions=POSITIONS)
    got = engine.generate([GenerationRequest(prompt, 12, logprobs=True)])[0]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                               pad_token_id=0)[0, len(prompt):].tolist()
        logits = hf(torch.tensor([got.tokens])).logits[0, :-1].log_softmax(-1)
    assert got.generated == expected
    scored = logits.gather(-1, torch.tensor(got.tokens[1:])[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(got.logprobs), scored, atol=1e-5, rtol=0)
