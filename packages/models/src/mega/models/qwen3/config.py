"""``Qwen3Config``: LLaMA's layers with QK-norm, RoPE base 10^6, norm epsilon 1e-6 as the defaults
(``QWEN3``, which Qwen3-MoE shares); see :mod:`mega.models.llama.config`."""

from __future__ import annotations

from mega.models.config import TransformerConfig
from mega.models.family_defaults import with_defaults
from mega.models.llama.config import LLAMA

QWEN3 = dict(LLAMA, rotary_base=1e6, layernorm_epsilon=1e-6, qk_layernorm=True)

Qwen3Config = with_defaults(TransformerConfig, "Qwen3Config", module=__name__, doc="Qwen3: LLaMA's layers with QK-norm, RoPE base 10^6, "
                            "norm epsilon 1e-6.", **QWEN3)
