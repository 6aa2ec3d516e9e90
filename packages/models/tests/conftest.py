"""Settings shared by mega-models' tests (``assert_close`` and ``worlds`` come from mega.testing)."""

from __future__ import annotations

import os

# Hugging Face models are built from configs; nothing may be downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
