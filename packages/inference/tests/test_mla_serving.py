"""DeepSeek-V3's multi-latent attention through the serving engines: mega-inference's paged and
static caches (sequences joining a running batch, as `mega serve` runs them) hold the compressed
latents as they hold keys and values, and each request gets the tokens the lock-step engine
(`mega generate`'s) gives it alone. (The cache's size and transformers' greedy tokens:
packages/models/tests/test_mla_cache.py, packages/ckpt-convert/tests/test_new_families.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from test_continuous import run_staggered  # noqa: E402

from mega.core.build import build_stage  # noqa: E402
from mega.inference.engine import GenerationEngine, GenerationRequest  # noqa: E402
from mega.inference.engine.continuous import ContinuousBatchingWorker  # noqa: E402
from mega.models.deepseek_v3.family import FAMILY, PRESETS  # noqa: E402


def test_continuous_batching_paged_and_static_caches_decode_as_each_alone():
    """mega serve's engine paths (mega-inference's paged and static caches: sequences joining a
    running batch) hold the MLA latents as they hold keys and values: each request gets the tokens
    the lock-step engine gives it alone."""
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=256, seq_length=16, mtp_num_layers=None,
                                 max_position_embeddings=64)
    model = build_stage(FAMILY, config, seed=5, training=False).eval()
    engine = GenerationEngine(model, vocab_size=256, max_positions=64)

    def requests():
        return [GenerationRequest([5, 17, 42, 8, 99, 3, 1], 10), GenerationRequest([7], 12),
                GenerationRequest(list(range(30, 50)), 6)]

    alone = [engine.generate([request])[0].tokens for request in requests()]
    for static in (False, True):
        worker = ContinuousBatchingWorker(engine, max_batch_size=3, max_num_tokens=3 * 64 if static else 96,
                                                     block_size=8, static_cache=static)
        worker.start()
        try:
            together = asyncio.run(run_staggered(worker, requests()))
        finally:
            worker.stop()
        assert [result.tokens for result in together] == alone, "static" if static else "paged"
