"""``mega serve`` under load, with continuous batching and with lock-step batching (#23).

The LLaMA model of ``bench_generate.py`` (6 layers, hidden 512, vocabulary 32000, random
weights) written as a mega checkpoint and served by ``mega serve --batching MODE
--max-batch-size 64`` in its own process. 1, 8, 32 and 64 concurrent clients each send greedy
``/v1/completions`` requests one after another; each request draws its prompt length and its
``max_tokens`` uniformly from ``--prompt-range`` and ``--tokens-range`` (seeded), as real
traffic mixes short and long requests. Columns: requests, generated tokens per second over the
level's wall time, median and 99th-percentile request latency. Both servers run side by side
(idle when not measured) and each concurrency level measures one then the other, so both see
the same machine load.

    python benchmarks/bench_serve.py
    python benchmarks/bench_serve.py --clients 64 --requests 128 --json
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
from bench_generate import free_port, hf_model, mega_weights  # noqa: E402


def start_server(args, directory: str, batching: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mega.core.cli.main", "serve", "--load", directory,
                               "--port", str(port), "--log-level", "warning", "--device", "cpu",
                               "--batching", batching, "--max-batch-size", str(args.max_batch_size)])
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


async def load(url: str, clients: int, requests_per_client: int, args) -> dict:
    generator = torch.Generator().manual_seed(clients)
    latencies: list[float] = []
    generated = 0

    def draw(low_high) -> int:
        low, high = low_high
        return int(torch.randint(low, high + 1, (), generator=generator))

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal generated
        for _ in range(requests_per_client):
            prompt = torch.randint(0, args.vocab - 1, (draw(args.prompt_range),), generator=generator).tolist()
            body = {"prompt": prompt, "max_tokens": draw(args.tokens_range), "temperature": 0}
            start = time.perf_counter()
            reply = await http.post("/v1/completions", json=body)
            latencies.append(time.perf_counter() - start)
            reply.raise_for_status()
            generated += reply.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=1200, limits=httpx.Limits(max_connections=clients)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - start
    latencies.sort()
    return {"clients": clients, "requests": len(latencies), "tokens_per_s": generated / wall,
            "p50_s": statistics.median(latencies), "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}


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
    parser.add_argument("--batching", nargs="+", default=["lockstep", "continuous"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.prompt, args.new_tokens = args.prompt_range[1], args.tokens_range[1]  # the model's positions

    rows = []
    with tempfile.TemporaryDirectory(prefix="mega-bench-serve-") as directory:
        from mega.core.checkpoint import CheckpointMetadata, write_checkpoint
        from mega.core.tokenizer import TokenizerOptions, TokenizerSpec

        config, weights = mega_weights("llama", hf_model("llama", args))
        write_checkpoint(directory, CheckpointMetadata(0, "llama", dataclasses.asdict(config)), weights,
                         tokenizer=TokenizerSpec("NullTokenizer", TokenizerOptions(vocab_size=args.vocab - 1)))
        servers = {batching: start_server(args, directory, batching) for batching in args.batching}
        try:
            for _, url in servers.values():
                asyncio.run(load(url, 1, 2, args))  # warm-up
            for clients in args.clients:
                requests = args.requests if clients > 1 else args.requests_one_client
                for batching, (_, url) in servers.items():
                    row = asyncio.run(load(url, clients, max(1, requests // clients), args))
                    rows.append({"batching": batching, **row})
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
    print(f"{'batching':<11}{'clients':>8}{'requests':>10}{'tok/s':>9}{'p50 s':>9}{'p99 s':>9}")
    for r in rows:
        print(f"{r['batching']:<11}{r['clients']:>8}{r['requests']:>10}{r['tokens_per_s']:>9.1f}{r['p50_s']:>9.3f}"
              f"{r['p99_s']:>9.3f}")


if __name__ == "__main__":
    main()
