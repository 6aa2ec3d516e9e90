"""LoRA adapters exported for PEFT: ``peft.PeftModel.from_pretrained`` on the transformers model
gives mega's logits (LLaMA: fused QKV and SwiGLU split; GPT-2: Conv1D, ``fan_in_fan_out``), the
merged tensors give the adapted model's function, and an adapter PEFT made, folded into mega's
weights, gives PEFT's logits."""

from __future__ import annotations

import json
import zlib

import peft  # the [test] extra's: the reference these tests compare with, never skipped
import pytest
import torch
import transformers

from mega.ckpt_convert.hf_peft import (  # noqa: E402
    fold_peft_adapter,
    merged_tensors,
    read_peft_adapter,
    write_peft_adapter,
)
from mega.core.build import build_stage  # noqa: E402
from mega.core.parameter_names import canonical_names  # noqa: E402
from mega.core.plugins import get_plugins  # noqa: E402
from mega.models.hf_mapping import mega_to_hf  # noqa: E402
from mega.models.lora.adapters import LoRASettings, adapter_parameters, apply_lora  # noqa: E402

SEQ = 12


def adapted_model(family_name):
    family = get_plugins().models.get(family_name)
    config = family.preset("tiny", vocab_size=128, make_vocab_size_divisible_by=128, seq_length=SEQ,
                           max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0, num_layers=2,
                           hidden_size=32, num_attention_heads=4, kv_channels=8, ffn_hidden_size=64,
                           **({"num_query_groups": 2} if family_name == "llama" else {}))
    model = build_stage(family, config, seed=2)
    apply_lora(model, LoRASettings(rank=4, alpha=12.0), seed=2)
    with torch.no_grad():
        for name, param in adapter_parameters(model).items():
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.1)
    names = canonical_names(model)
    tensors = {names.get(n, n): t.detach() for n, t in (*model.named_parameters(), *model.named_buffers())}
    return family, config, model, tensors


def hf_model(family, config, tensors):
    mapping = family.hf_mapping
    hf_config = transformers.AutoConfig.for_model(**mapping.config_to_hf(config))
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    state = mega_to_hf(mapping, {n: t for n, t in tensors.items() if ".adapter." not in n}, config)
    model.load_state_dict(state, strict=False)
    return model


@pytest.mark.parametrize("family_name", ["llama", "gpt"])
def test_peft_loads_mega_adapters_with_the_same_logits(tmp_path, family_name):
    family, config, model, tensors = adapted_model(family_name)
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).transpose(0, 1)[..., : config.vocab_size]
    modules = write_peft_adapter(tmp_path / "adapter", family.hf_mapping, config, tensors, base_model="tiny")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 12.0 and written["fan_in_fan_out"] == (family_name == "gpt")
    peft_model = peft.PeftModel.from_pretrained(hf_model(family, config, tensors), str(tmp_path / "adapter")).eval()
    lora_layers = [name for name, _ in peft_model.named_modules() if name.endswith(".lora_A")]
    assert len(lora_layers) == len(modules) == (14 if family_name == "llama" else 8)
    with torch.no_grad():
        got = peft_model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    # Merged into the base weights, the plain transformers model computes the same.
    merged = hf_model(family, config, merged_tensors(tensors))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family_name", ["llama", "gpt"])
def test_a_peft_made_adapter_folds_into_mega(tmp_path, family_name):
    family, config, model, tensors = adapted_model(family_name)
    base = {name: tensor for name, tensor in tensors.items() if ".adapter." not in name}
    targets = {"llama": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"], "gpt": ["c_attn", "c_fc"]}
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets[family_name], init_lora_weights=False,
                           fan_in_fan_out=family_name == "gpt", use_rslora=family_name == "llama")
    torch.manual_seed(5)
    peft_model = peft.get_peft_model(hf_model(family, config, base), lora).eval()
    peft_model.save_pretrained(str(tmp_path / "made-by-peft"))
    adapter_config, adapter = read_peft_adapter(tmp_path / "made-by-peft")
    folded = fold_peft_adapter(family.hf_mapping, config, base, adapter_config, adapter)
    mega_model = build_stage(family, config, seed=9)
    names = {canonical: name for name, canonical in canonical_names(mega_model).items()}
    mega_model.load_state_dict({names.get(n, n): t for n, t in folded.items()})
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = peft_model(ids).logits
        with peft_model.disable_adapter():
            assert not torch.allclose(peft_model(ids).logits, expected, atol=1e-3)  # the adapter matters
        got = mega_model(ids).transpose(0, 1)[..., : config.vocab_size]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
