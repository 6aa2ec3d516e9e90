"""Index building for GPT samples and blends: mega's numpy against megatron-core's C++ helpers.

    python benchmarks/bench_data_indices.py [--tokens 1e8 1e9] [--sequence-length 2048] [--json PATH]

For each size, both build the three GPTDataset indices for a synthetic corpus (document lengths
uniform in 1..2047 tokens) asked for two epochs' worth of samples, from the same seed: the
document index and the shuffle index come from numpy's RandomState in both (the same calls), the
sample index from ``helpers.build_sample_idx`` (C++) in megatron-core and from one vectorised
``searchsorted`` in mega. Results must be identical; times are the best of ``--repeat`` runs.
Blending indices (Megatron's greedy "largest error first" order) are compared the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def best_time(function, repeat: int):
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return best, result


def megatron_gpt_indices(lengths, documents, num_samples, sequence_length, seed):
    """megatron-core's GPTDataset._build_document_sample_shuffle_indices, minus its caching."""
    from megatron.core.datasets import helpers
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index

    tokens_per_epoch = int(np.sum(lengths[documents]))
    num_epochs = -(-(num_samples * sequence_length + 1) // tokens_per_epoch)
    before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // sequence_length
    per_epoch = (tokens_per_epoch - 1) // sequence_length
    separate = num_epochs > 1 and (num_samples - before_final) < int(0.8 * per_epoch)
    state = np.random.RandomState(seed)
    document_index = _build_document_index(documents, num_epochs, state, separate)
    start = time.perf_counter()
    sample_index = helpers.build_sample_idx(lengths, document_index, sequence_length, num_epochs, tokens_per_epoch, True, True)
    sample_seconds = time.perf_counter() - start
    size = sample_index.shape[0] - 1
    shuffle_index = _build_shuffle_index(before_final if separate else size, size, state)
    return (document_index, sample_index, shuffle_index), sample_seconds


def mega_gpt_indices(lengths, documents, num_samples, sequence_length, seed):
    from mega.data import sample_index as si

    tokens_per_epoch = int(np.sum(lengths[documents], dtype=np.int64))
    num_epochs = si.num_epochs_needed(tokens_per_epoch, num_samples, sequence_length, 1)
    separate, before_final = si.separate_final_epoch(num_epochs, tokens_per_epoch, num_samples, sequence_length, 1)
    state = np.random.RandomState(seed)
    document_index = si.build_document_index(documents, num_epochs, state, separate)
    start = time.perf_counter()
    sample_index = si.build_sample_index(lengths, document_index, sequence_length, num_epochs, tokens_per_epoch)
    sample_seconds = time.perf_counter() - start
    size = sample_index.shape[0] - 1
    shuffle_index = si.build_shuffle_index(before_final if separate else size, size, state)
    return (document_index, sample_index, shuffle_index), sample_seconds


def bench_gpt(tokens: float, sequence_length: int, repeat: int) -> dict:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2048, int(tokens // 1024) + 1, dtype=np.int32)
    documents = np.arange(len(lengths), dtype=np.int32)
    num_samples = int(2 * lengths.sum(dtype=np.int64) // sequence_length) - 1  # two epochs
    row = {"tokens": int(lengths.sum(dtype=np.int64)), "documents": len(lengths), "samples": num_samples,
           "sequence_length": sequence_length}
    for name, build in (("megatron", megatron_gpt_indices), ("mega", mega_gpt_indices)):
        total, (indices, sample_seconds) = best_time(lambda b=build: b(lengths, documents, num_samples, sequence_length, 1234), repeat)
        row[name] = {"total_s": total, "sample_index_s": sample_seconds}
        row[f"{name}_indices"] = indices
    for ours, theirs in zip(row.pop("mega_indices"), row.pop("megatron_indices"), strict=True):
        if not np.array_equal(ours, theirs):
            sys.exit("FAIL: mega's GPT indices differ from megatron-core's")
    return row


def bench_blend(samples: int, datasets: int, repeat: int) -> dict:
    from megatron.core.datasets import helpers

    from mega.data.blending import build_blending_indices, normalize

    weights = normalize(np.arange(1, datasets + 1, dtype=np.float64) ** 1.5)

    def megatron():
        index, sample = np.zeros(samples, np.int16), np.zeros(samples, np.int64)
        helpers.build_blending_indices(index, sample, np.array(weights), datasets, samples, False)
        return index, sample

    megatron_s, expected = best_time(megatron, repeat)
    mega_s, got = best_time(lambda: build_blending_indices(weights, samples), repeat)
    if not (np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])):
        sys.exit("FAIL: mega's blending indices differ from megatron-core's")
    return {"samples": samples, "datasets": datasets, "megatron_s": megatron_s, "mega_s": mega_s}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=float, nargs="+", default=[1e7, 1e8, 1e9], help="corpus sizes in tokens")
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--blend-samples", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--blend-datasets", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    gpt_rows = [bench_gpt(tokens, args.sequence_length, args.repeat) for tokens in args.tokens]
    print(f"GPT indices (document + sample + shuffle), sequence length {args.sequence_length}, two epochs, best of {args.repeat}:\n")
    print("| tokens | documents | samples | megatron-core total s | mega total s | sample index: C++ s | sample index: mega s |")
    print("|---|---|---|---|---|---|---|")
    for r in gpt_rows:
        print(f"| {r['tokens']:,} | {r['documents']:,} | {r['samples']:,} | {r['megatron']['total_s']:.3f} | "
              f"{r['mega']['total_s']:.3f} | {r['megatron']['sample_index_s']:.4f} | {r['mega']['sample_index_s']:.4f} |")

    blend_rows = [bench_blend(s, d, args.repeat) for s in args.blend_samples for d in args.blend_datasets]
    print(f"\nBlending indices, best of {args.repeat}:\n")
    print("| samples | datasets | megatron-core C++ s | mega numpy s | mega / C++ |")
    print("|---|---|---|---|---|")
    for r in blend_rows:
        print(f"| {r['samples']:,} | {r['datasets']} | {r['megatron_s']:.3f} | {r['mega_s']:.3f} | {r['mega_s'] / r['megatron_s']:.1f}x |")
    print("\nall indices identical to megatron-core's: yes")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpt": gpt_rows, "blend": blend_rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
