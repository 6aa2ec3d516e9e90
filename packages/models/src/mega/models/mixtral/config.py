"""``MixtralConfig``: LLaMA's layers (RoPE base 10^6) with a top-2 mixture of SwiGLU experts as the
defaults; see :mod:`mega.models.llama.config`."""

from __future__ import annotations

from mega.models.family_defaults import with_defaults
from mega.models.llama.config import LLAMA
from mega.models.moe.config import MoETransformerConfig

MixtralConfig = with_defaults(MoETransformerConfig, "MixtralConfig", module=__name__, doc="Mixtral: LLaMA's layers (RoPE base 10^6) with "
                              "a top-2 mixture of SwiGLU experts.", **dict(LLAMA, rotary_base=1e6))
