"""``--rope-type``'s frequencies against transformers' ``ROPE_INIT_FUNCTIONS``, on the CPU (tensors
made there, so it passes on a GPU machine too).

Dynamic NTK scaling takes each row's own length (its last position + 1) in a batch of sequences
at different positions, as transformers does for that sequence alone (and is refused with context
parallelism, whose ranks see no whole length); the config refuses contradictory settings by flag.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mega.models.blocks.rope import inverse_frequencies, rotary_cos_sin  # noqa: E402
from mega.models.config import ModelConfigError  # noqa: E402
from mega.models.llama.config import LlamaConfig  # noqa: E402
from mega.models.llama.hf_llama import llama_config  # noqa: E402

CPU = torch.device("cpu")
HF = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=32, rope_theta=10000.0)


def transformers_inverse_frequencies(rope_scaling: dict, seq_len: int | None = None) -> torch.Tensor:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(**HF, rope_scaling=dict(rope_scaling))
    seq = None if seq_len is None else torch.tensor(seq_len)
    return ROPE_INIT_FUNCTIONS[rope_scaling["rope_type"]](config, CPU, seq_len=seq)[0]


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "beta_fast": 16.0, "beta_slow": 2.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "truncate": False},
    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 16},
], ids=["linear", "yarn", "yarn-untruncated", "llama3"])
def test_static_kinds_equal_transformers_frequencies(rope_scaling):
    config = llama_config({**HF, "rope_scaling": rope_scaling})
    torch.testing.assert_close(inverse_frequencies(config, CPU), transformers_inverse_frequencies(rope_scaling),
                               rtol=1e-6, atol=0)


def test_dynamic_takes_each_rows_own_length():
    rope_scaling = {"rope_type": "dynamic", "factor": 2.0}
    config = llama_config({**HF, "rope_scaling": rope_scaling})
    assert config.original_max_position_embeddings == 32 and config.max_position_embeddings == 64
    lengths = [10, 40, 57]  # within the original context, past it, further past it
    position_ids = torch.tensor([[length - 1] for length in lengths])  # one decoding step per row
    cos, sin = rotary_cos_sin(config, 1, position_ids, CPU)  # [1, rows, 1, d/2]
    for row, length in enumerate(lengths):
        angles = (length - 1) * transformers_inverse_frequencies(rope_scaling, length)
        torch.testing.assert_close(cos[0, row, 0], angles.cos(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin[0, row, 0], angles.sin(), rtol=1e-6, atol=1e-6)
    plain = 1.0 / HF["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    torch.testing.assert_close(cos[0, 0, 0], (9 * plain).cos())  # within the original context: plain
    assert not torch.allclose(cos[0, 1, 0], (39 * plain).cos()), "past it the frequencies must change"


def test_contradictory_rope_settings_are_refused_by_flag():
    assert LlamaConfig(use_rope_scaling=True).rope_type == "llama3"
    assert LlamaConfig(rope_type="llama3").use_rope_scaling
    with pytest.raises(ModelConfigError, match="--use-rope-scaling"):
        LlamaConfig(use_rope_scaling=True, rope_type="yarn", rotary_scaling_factor=4.0)
    with pytest.raises(ModelConfigError, match="--rope-type must be one of"):
        LlamaConfig(rope_type="longrope")
    with pytest.raises(ModelConfigError, match="--rotary-scaling-factor"):
        LlamaConfig(rope_type="linear", rotary_scaling_factor=0.5)


def test_dynamic_scaling_is_refused_with_context_parallelism():
    from mega.core.parallel import ParallelConfig
    from mega.models.blocks.context_parallel import check_context_parallel

    config = LlamaConfig(rope_type="dynamic", rotary_scaling_factor=2.0, attention_dropout=0.0)
    with pytest.raises(ModelConfigError, match="--rope-type dynamic with --context-parallel-size 2"):
        check_context_parallel(config, ParallelConfig(cp=2))
    check_context_parallel(LlamaConfig(rope_type="yarn", rotary_scaling_factor=2.0, attention_dropout=0.0),
                           ParallelConfig(cp=2))
