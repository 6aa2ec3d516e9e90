"""``mega serve`` under faults (issue 47): many clients mixing good requests with ~4 MB prompts,
dropped connections and bad fields, for a fixed time.

A small random LLaMA (mega checkpoint, ids-as-text tokens: NullTokenizer) is served by ``mega
serve --max-num-queued-reqs Q`` in its own process. First every good request is sent alone and
its greedy text kept. Then ``--clients`` clients each loop for ``--seconds``, drawing (seeded)
one of: a good request (greedy, non-streaming or streamed; a 429 is retried after its
Retry-After), a ~4 MB prompt (under the 4 MiB body limit; refused with 400), a dropped
connection (a request sent, then the socket closed before the answer, streaming or not), or a
bad field (a ``logit_bias`` key "²", an unknown field, 129 prompts, ``[]``, ``[[]]``, a seed of
2**64, malformed JSON, a wrong model). A separate process probes ``GET /health`` every 20 ms
throughout, and for ``--idle-seconds`` before the load (the server idle: what the machine
itself adds). Reported: the answers by status (target: none 5xx), ``/health`` p50/p99/max (target
p99 < 100 ms) under the load and idle, the server's resident memory after the load (once idle) over before it (target
within 10%), and the good requests whose text differs from their text alone (target 0).

    python benchmarks/bench_serve_faults.py                   # 64 clients, 60 s
    python benchmarks/bench_serve_faults.py --clients 8 --seconds 10 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

import httpx
import torch
import transformers

from mega.core.checkpoint import CheckpointMetadata, write_checkpoint
from mega.core.plugins import get_plugins
from mega.core.tokenizer import TokenizerOptions, TokenizerSpec
from mega.models.hf_mapping import hf_to_mega

HUGE_PROMPT_BYTES = 4_000_000  # under the default 4 MiB body limit
BAD_BODIES = [
    {"prompt": "5 6", "logit_bias": {"²": 1}},
    {"prompt": "5 6", "max_tokne": 3},
    {"prompt": ["5"] * 129},
    {"prompt": []},
    {"prompt": [[]]},
    {"prompt": "5 6", "seed": 2**64},
    {"prompt": "5 6", "model": "no-such-model"},
    {"prompt": "5 6", "temperature": -1},
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="/health probed on the idle server first")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-num-queued-reqs", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser.parse_args()


def write_model(directory: str, args) -> None:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.positions)).eval()
    mapping = get_plugins().models.get("llama").hf_mapping
    config = mapping.config_from_hf(hf.config.to_dict())
    write_checkpoint(directory, CheckpointMetadata(0, "llama", dataclasses.asdict(config)),
                     hf_to_mega(mapping, hf.state_dict(), config),
                     tokenizer=TokenizerSpec("NullTokenizer", TokenizerOptions(vocab_size=args.vocab - 1)))


def start_server(directory: str, args) -> tuple[subprocess.Popen, str, int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "mega.core.cli.main", "serve", "--load", directory,
                               "--port", str(port), "--log-level", "error", "--device", "cpu",
                               "--max-batch-size", str(args.max_batch_size),
                               "--max-num-queued-reqs", str(args.max_num_queued_reqs)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return server, url, port
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("mega serve did not start within 300 s")


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def probe_health(url: str, stop, results) -> None:
    """In its own process (no share of the load's interpreter): GET /health every 20 ms."""
    latencies = []
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            start = time.perf_counter()
            http.get(f"{url}/health")
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
    results.put(latencies)


@contextlib.contextmanager
def probing(url: str):
    """``/health`` probed from another process while the block runs; the list fills at its end."""
    latencies: list[float] = []
    stop, results = multiprocessing.Event(), multiprocessing.Queue()
    prober = multiprocessing.Process(target=probe_health, args=(url, stop, results))
    prober.start()
    try:
        yield latencies
    finally:
        stop.set()
        latencies.extend(sorted(results.get()))
        prober.join()


def latencies(name: str, values: list[float]) -> dict:
    return {f"{name}_probes": len(values), f"{name}_p50_ms": 1000 * statistics.median(values),
            f"{name}_p99_ms": 1000 * values[int(0.99 * (len(values) - 1))], f"{name}_max_ms": 1000 * values[-1]}


def good_requests(args) -> list[dict]:
    draw = random.Random(args.seed)
    return [{"prompt": " ".join(str(draw.randrange(args.vocab - 1)) for _ in range(draw.randint(4, 48))),
             "max_tokens": draw.randint(4, 24), "temperature": 0} for _ in range(24)]


async def text_of(http: httpx.AsyncClient, body: dict, stream: bool) -> tuple[int, str | None]:
    if not stream:
        reply = await http.post("/v1/completions", json=body)
        return reply.status_code, reply.json()["choices"][0]["text"] if reply.status_code == 200 else None
    pieces = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return reply.status_code, None
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    return 200, "".join(pieces)


async def dropped(port: int, body: dict, stream: bool, after_s: float) -> None:
    """A request sent whole, then the connection closed before the answer ends."""
    payload = json.dumps({**body, "stream": stream}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    await asyncio.sleep(after_s)
    writer.close()


async def load(url: str, port: int, args, expected: list[str]) -> dict:
    statuses: Counter = Counter()
    kinds: Counter = Counter()
    transport_errors: Counter = Counter()
    wrong: list[int] = []
    goods = good_requests(args)
    huge = json.dumps({"prompt": "5 " * (HUGE_PROMPT_BYTES // 2 - 16), "max_tokens": 4}).encode()
    end = time.monotonic() + args.seconds

    async def client(number: int, http: httpx.AsyncClient) -> None:
        draw = random.Random(args.seed * 1000 + number)
        while time.monotonic() < end:
            kind = draw.choices(["good", "huge", "dropped", "bad"], weights=[50, 10, 15, 25])[0]
            kinds[kind] += 1
            try:
                await one(kind, draw, http)
            except httpx.TransportError as error:  # e.g. a keep-alive connection the server closed as it was reused
                transport_errors[f"{kind}: {type(error).__name__}"] += 1

    async def one(kind: str, draw: random.Random, http: httpx.AsyncClient) -> None:
        if kind == "good":
            index = draw.randrange(len(goods))
            while True:
                status, text = await text_of(http, goods[index], stream=draw.random() < 0.5)
                statuses[status] += 1
                if status != 429:
                    break
                await asyncio.sleep(1.0)
            if status == 200 and text != expected[index]:
                wrong.append(index)
        elif kind == "huge":
            reply = await http.post("/v1/completions", content=huge, headers={"content-type": "application/json"})
            statuses[reply.status_code] += 1
        elif kind == "dropped":
            body = {"prompt": goods[draw.randrange(len(goods))]["prompt"], "max_tokens": 64, "temperature": 0}
            await dropped(port, body, stream=draw.random() < 0.5, after_s=draw.uniform(0.05, 0.5))
        else:
            if draw.random() < 0.15:
                reply = await http.post("/v1/completions", content=b'{"prompt": "5 6",',
                                        headers={"content-type": "application/json"})
            else:
                reply = await http.post("/v1/completions", json=draw.choice(BAD_BODIES))
            statuses[reply.status_code] += 1

    limits = httpx.Limits(max_connections=args.clients + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(number, http) for number in range(args.clients)))
    return {"statuses": dict(sorted(statuses.items())), "kinds": dict(kinds), "wrong_text": len(wrong),
            "transport_errors": dict(transport_errors)}


def gauges(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(("mega_running_sequences", "mega_queued_sequences")):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as directory:
        write_model(directory, args)
        server, url, port = start_server(directory, args)
        try:
            async def alone() -> list[str]:
                async with httpx.AsyncClient(base_url=url, timeout=600) as http:
                    return [(await text_of(http, body, stream=False))[1] for body in good_requests(args)]

            expected = asyncio.run(alone())
            time.sleep(1.0)
            before = resident_bytes(server.pid)
            with probing(url) as idle_health:
                time.sleep(args.idle_seconds)
            with probing(url) as health:
                outcome = asyncio.run(load(url, port, args, expected))
            deadline = time.monotonic() + 60
            while any(gauges(url).values()) and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(2.0)
            after = resident_bytes(server.pid)
            idle = gauges(url)
        finally:
            server.terminate()
            server.wait(timeout=60)
    errors = sum(count for status, count in outcome["statuses"].items() if status >= 500)
    report = {"clients": args.clients, "seconds": args.seconds, **outcome, "responses_5xx": errors,
              **latencies("health", health), **latencies("idle_health", idle_health),
              "rss_before_mb": before / 2**20, "rss_after_mb": after / 2**20, "rss_ratio": after / before,
              "idle_gauges": idle}
    if args.json:
        print(json.dumps(report))
        return
    print(f"{args.clients} clients for {args.seconds:g} s: requests by kind {outcome['kinds']}")
    print(f"answers by status {outcome['statuses']}; 5xx: {errors} (target 0); connections that failed "
          f"(no answer): {outcome['transport_errors'] or 0}")
    for name, when in (("health", "under the load"), ("idle_health", "idle, before it")):
        print(f"/health {when} over {report[name + '_probes']} probes: p50 {report[name + '_p50_ms']:.1f} ms, p99 "
              f"{report[name + '_p99_ms']:.1f} ms (target < 100), max {report[name + '_max_ms']:.1f} ms")
    print(f"resident memory: {report['rss_before_mb']:.0f} MB before, {report['rss_after_mb']:.0f} MB after "
          f"(x{report['rss_ratio']:.3f}; target within 10%)")
    print(f"good requests whose greedy text differs from their text alone: {outcome['wrong_text']} (target 0)")
    print(f"gauges once idle: {idle}")


if __name__ == "__main__":
    main()
