"""One device, fp32: mega's GPT and LLaMA compute what Hugging Face's GPT-2 and LLaMA compute,
given the same weights mapped by the families' Hugging Face mappings (mega.models.gpt.hf_gpt2,
mega.models.llama.hf_llama)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from mega.core.build import build_stage  # noqa: E402
from mega.models import hf_mapping  # noqa: E402
from mega.models.gpt.family import FAMILY as GPT_FAMILY  # noqa: E402
from mega.models.gpt.hf_gpt2 import GPT2, gpt2_config, gpt2_hf_config  # noqa: E402
from mega.models.llama.family import FAMILY as LLAMA_FAMILY  # noqa: E402
from mega.models.llama.hf_llama import LLAMA, llama_config, llama_hf_config  # noqa: E402

BATCH, SEQ = 2, 16


def tokens(vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def mega_from_hf(hf_model, config):
    mapping = GPT2 if config.position_embedding_type == "learned_absolute" else LLAMA
    model = build_stage(mapping_family(config), config, init=False)
    model.load_state_dict(hf_mapping.hf_to_mega(mapping, hf_model.state_dict(), config))
    return model.eval()


def compare_logits(hf_model, config, assert_close):
    ids = tokens(config.vocab_size)
    with torch.no_grad():
        expected = hf_model(ids).logits  # [b, s, V]
        model = mega_from_hf(hf_model, config)
        logits = model(ids).transpose(0, 1)  # [b, s, padded V]
    assert logits.shape[-1] == config.padded_vocab_size() > config.vocab_size
    assert_close(logits[..., : config.vocab_size], expected, what="logits")
    # The loss path on the same logits, against torch's cross-entropy of Hugging Face's.
    labels = tokens(config.vocab_size, seed=1)
    losses = model.loss(model(ids), labels)
    # The padded vocabulary rows take no part: the loss is Hugging Face's over the real vocabulary.
    reference = F.cross_entropy(expected.flatten(0, 1), labels.flatten(), reduction="none").view(BATCH, SEQ)
    assert_close(losses.detach(), reference, what="loss")


def test_gpt2_logits_match_hugging_face(assert_close):
    hf_config = transformers.GPT2Config(vocab_size=250, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                        initializer_range=0.1)  # large weights: differences show
    torch.manual_seed(0)
    hf_model = transformers.GPT2LMHeadModel(hf_config).eval()
    config = gpt2_config(hf_config.to_dict())
    assert config.openai_gelu and not config.untie_embeddings_and_output_weights
    compare_logits(hf_model, config, assert_close)


@pytest.mark.parametrize("variant", ["llama2", "llama3.1-rope-scaling", "tied-with-bias"])
def test_llama_logits_match_hugging_face(variant, assert_close):
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    extra = {}
    if variant == "llama3.1-rope-scaling":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if variant == "tied-with-bias":
        extra = {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}
    hf_config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_parameters=rope,
        initializer_range=0.1, **extra,
    )
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    if variant == "tied-with-bias":  # Hugging Face initialises biases to zero: make them count
        with torch.no_grad():
            for name, param in hf_model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.1)
    config = llama_config(hf_config.to_dict())
    assert config.use_rope_scaling == (variant == "llama3.1-rope-scaling")
    assert config.num_query_groups == 2 and config.swiglu
    compare_logits(hf_model, config, assert_close)


def test_mappings_round_trip_exactly():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=250, n_embd=32, n_layer=2, n_head=4,
                                                                n_positions=16))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    for hf_model, get_config, mapping in [(gpt2, gpt2_config, GPT2), (llama, llama_config, LLAMA)]:
        config = get_config(hf_model.config.to_dict())
        original = hf_model.state_dict()
        back = hf_mapping.mega_to_hf(mapping, hf_mapping.hf_to_mega(mapping, original, config), config)
        # A tied output layer is the embedding: checkpoints hold it once.
        tied = {"lm_head.weight"} if not config.untie_embeddings_and_output_weights else set()
        assert set(back) == set(original) - tied
        for name, tensor in back.items():
            assert torch.equal(tensor, original[name]), name


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_configs_round_trip_through_hugging_face(family):
    """mega config -> config.json -> mega config is the identity on what the model computes."""
    from mega.models.gpt.family import PRESETS as GPT_PRESETS
    from mega.models.llama.family import PRESETS as LLAMA_PRESETS

    if family == "gpt2":
        configs, to_hf, from_hf = [GPT_PRESETS["125m"]], gpt2_hf_config, gpt2_config
    else:
        configs, to_hf, from_hf = [LLAMA_PRESETS["llama3-8b"], LLAMA_PRESETS["llama3-405b"]], llama_hf_config, llama_config
    for config in configs:
        assert from_hf(to_hf(config), seq_length=config.seq_length) == config


def test_configs_hugging_face_cannot_express_are_refused():
    from mega.models.gpt.family import PRESETS as GPT_PRESETS
    from mega.models.llama.family import PRESETS as LLAMA_PRESETS

    with pytest.raises(ValueError, match="GPT2LMHeadModel cannot express.*position_embedding_type.*swiglu"):
        gpt2_hf_config(LLAMA_PRESETS["tiny"])
    with pytest.raises(ValueError, match="LlamaForCausalLM cannot express.*normalization"):
        llama_hf_config(GPT_PRESETS["tiny"])


def test_qkv_interleave_is_per_query_group():
    # 4 query heads in 2 groups, head size 1: rows are q0 q1 k0 v0 | q2 q3 k1 v1.
    q, k, v = torch.tensor([[0.], [1.], [2.], [3.]]), torch.tensor([[10.], [11.]]), torch.tensor([[20.], [21.]])
    fused = hf_mapping.interleave_qkv(q, k, v, num_query_groups=2)
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_unsupported_hugging_face_configs_are_refused():
    with pytest.raises(ValueError, match="activation_function 'relu'"):
        gpt2_config(transformers.GPT2Config(activation_function="relu").to_dict())
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 64, "long_factor": [2.0] * 64,
                "original_max_position_embeddings": 1024}
    with pytest.raises(ValueError, match="rope_scaling.rope_type 'longrope'"):
        llama_config(transformers.LlamaConfig(rope_parameters=longrope).to_dict())
    with pytest.raises(ValueError, match="rope_scaling.rope_type 'longrope'"):  # transformers 4.x keys
        llama_config({"rope_theta": 1e4, "rope_scaling": {"type": "longrope", "factor": 2.0}})
    # yarn (linear, dynamic, llama3) are mega's --rope-type, in either version's keys.
    assert llama_config({"rope_theta": 1e4, "rope_scaling": {"type": "yarn", "factor": 2.0}}).rope_type == "yarn"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_explicit_position_ids_match_hugging_face(family, assert_close):
    """Position ids reach RoPE and the learned table (restarting and strided: RoPE ignores a
    constant offset, relative positions must change for the check to mean something)."""
    torch.manual_seed(0)
    if family == "gpt2":
        hf_config = transformers.GPT2Config(vocab_size=250, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                            initializer_range=0.1)
        hf_model, config = transformers.GPT2LMHeadModel(hf_config).eval(), gpt2_config(hf_config.to_dict())
    else:
        hf_config = transformers.LlamaConfig(vocab_size=250, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, initializer_range=0.1)
        hf_model, config = transformers.LlamaForCausalLM(hf_config).eval(), llama_config(hf_config.to_dict())
    ids = tokens(250)
    positions = torch.stack([torch.arange(SEQ) % 6, 2 * torch.arange(SEQ) + 3])
    with torch.no_grad():
        expected = hf_model(ids, position_ids=positions).logits
        logits = mega_from_hf(hf_model, config)(ids, positions).transpose(0, 1)[..., :250]
        default = mega_from_hf(hf_model, config)(ids).transpose(0, 1)[..., :250]
    assert_close(logits, expected, what="logits")
    assert not torch.allclose(default, expected, rtol=1e-3)  # the positions mattered


def mapping_family(config):
    return GPT_FAMILY if config.position_embedding_type == "learned_absolute" else LLAMA_FAMILY
