"""mega-models: Transformer blocks and model families for mega.

``variant(family, name, **config_defaults)`` derives a family (see :mod:`mega.models.variant`).
"""

from mega.models.variant import variant

__all__ = ["variant"]
