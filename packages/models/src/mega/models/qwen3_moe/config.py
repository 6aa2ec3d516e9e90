"""``Qwen3MoEConfig``: Qwen3's attention with a mixture of SwiGLU experts as the defaults; see
:mod:`mega.models.qwen3.config`."""

from __future__ import annotations

from mega.models.family_defaults import with_defaults
from mega.models.moe.config import MoETransformerConfig
from mega.models.qwen3.config import QWEN3

Qwen3MoEConfig = with_defaults(MoETransformerConfig, "Qwen3MoEConfig", module=__name__, doc="Qwen3-MoE: Qwen3's attention with a "
                               "mixture of SwiGLU experts.", **QWEN3)
