"""Generation: mega's engine against Hugging Face ``generate``, and ``mega serve`` under load.

Part 1, the engine: both hold the same random weights (mapped by the families' ``hf_mapping``)
and generate greedily, with their KV caches, ``--new-tokens`` tokens after prompts of
``--prompt`` tokens, at batch 1 and 8. mega runs its one decoder loop twice: on the paged KV
cache, and on the static KV cache (on CUDA its decode step is a captured CUDA graph, as ``mega
generate`` and ``mega serve`` decode there by default). Columns: median seconds per generate call, generated
tokens per second, mega's speed relative to Hugging Face's (the outputs are checked equal), the
fraction of the memory-bandwidth limit each reaches (a decode step reads every weight once, so
at batch ``b`` the limit is ``b x bandwidth / weight bytes`` tokens per second, the bandwidth
measured on the device by timing large copies first), and the static path's time to first token
and inter-token latency percentiles (from the engine's per-token callback).

Part 2, the server: the LLaMA model written as a mega checkpoint, served by ``mega serve`` in its
own process; 1, 8 and 32 concurrent clients each send greedy ``/v1/completions`` requests one
after another, streaming. Columns: requests, generated tokens per second over the whole run, median and
99th-percentile request latency, time to first token and inter-token latency (p50, p99), and the
prefix-cache hit rate (from ``/metrics``).

    python benchmarks/bench_generate.py
    python benchmarks/bench_generate.py --family gpt --batches 1 --json
    # the LLaMA 1.2B shape on a GPU (#23's decode table):
    python benchmarks/bench_generate.py --family llama --device cuda --dtype bfloat16 --layers 16 \
        --hidden 2048 --heads 16 --vocab 128256 --prompt 128 --new-tokens 128 --batches 1 16 --no-server
    # the same, reading each step's tokens at once (a host synchronisation per token), to compare:
    python benchmarks/bench_generate.py ... --read-lag 0

The per-token callback runs when the host reads a token, ``--read-lag`` steps after the device
chose it: the time to first token includes those steps; inter-token gaps are the steps' own.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from mega.core.build import build_stage  # noqa: E402
from mega.core.plugins import get_plugins  # noqa: E402
from mega.inference.engine import GenerationEngine, GenerationRequest  # noqa: E402
from mega.inference.engine.continuous import ContinuousBatchingWorker  # noqa: E402
from mega.inference.engine.decode_step import READ_LAG  # noqa: E402
from mega.inference.engine.worker import ENGINE_THREAD_OS_NAME  # noqa: E402
from mega.models.hf_mapping import hf_to_mega  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run by path (the GPU suite's dry run) too
from kernel_profile import as_json, difference, markdown, profile_steps  # noqa: E402


def hf_model(family: str, args):
    h, layers, heads, vocab = args.hidden, args.layers, args.heads, args.vocab
    positions = args.prompt + args.new_tokens
    torch.manual_seed(0)
    # No end-of-text token: Hugging Face would stop at it, or with min_new_tokens forbid it, where
    # mega's engine (asked for no stop) takes it like any token; a random LLaMA picks its id 2 at times.
    if family == "gpt":
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=h, n_layer=layers, n_head=heads, n_positions=positions,
                                         eos_token_id=None)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=int(8 * h / 3) // 64 * 64,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=max(1, heads // 2), max_position_embeddings=positions,
                                      eos_token_id=None)
    return transformers.LlamaForCausalLM(config).eval()


def placed(model: torch.nn.Module, args) -> torch.nn.Module:
    return model.to(device=args.device, dtype=getattr(torch, args.dtype))


def mega_weights(family: str, model):
    mapping = get_plugins().models.get(family).hf_mapping
    config = mapping.config_from_hf(model.config.to_dict())
    return config, hf_to_mega(mapping, model.state_dict(), config)


def mega_engine(family: str, model, args) -> GenerationEngine:
    config, weights = mega_weights(family, model)
    mega_model = build_stage(get_plugins().models.get(family), config, init=False)
    mega_model.load_state_dict(weights)
    return GenerationEngine(placed(mega_model.eval(), args), vocab_size=config.vocab_size,
                            max_positions=config.max_position_embeddings, read_lag=getattr(args, "read_lag", None))


def measure_bandwidth(device: str) -> float:
    """The device's memory bandwidth in bytes/s: large copies timed (each reads and writes its size)."""
    size = (1 << 30) if device.startswith("cuda") else (256 << 20)
    source = torch.empty(size // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up
    copies = 20 if device.startswith("cuda") else 5
    seconds, _ = time_call(lambda: [target.copy_(source) for _ in range(copies)])
    return 2 * size * copies / seconds


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class TokenClock:
    """Times each request's tokens through an engine's ``on_token`` callback: time to first
    token from the call's start, and the gaps between a request's later tokens."""

    def __init__(self):
        self.start, self.last, self.first, self.gaps = 0.0, {}, [], []

    def begin(self) -> None:
        self.start, self.last = time.perf_counter(), {}

    def __call__(self, index: int, *_) -> None:
        now = time.perf_counter()
        if index in self.last:
            self.gaps.append(now - self.last[index])
        else:
            self.first.append(now - self.start)
        self.last[index] = now


def time_call(fn) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def bench_engine(family: str, batch: int, args) -> dict:
    model = hf_model(family, args)
    engine = mega_engine(family, model, args)
    model = placed(model, args)
    # The loop on the static cache, a slot per request, kept across runs (CUDA graphs on CUDA).
    static = ContinuousBatchingWorker(engine, max_batch_size=batch, max_num_tokens=batch * engine.max_positions,
                                      static_cache=True, compile_backend="inductor" if args.compile else None)
    prompts = torch.randint(0, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
    requests = [GenerationRequest(p, args.new_tokens) for p in prompts.tolist()]
    prompts = prompts.to(args.device)

    def hf_generate():
        with torch.inference_mode():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                 max_new_tokens=args.new_tokens, pad_token_id=0)
        return out[:, args.prompt:].tolist()

    clock = TokenClock()

    def mega_generate():
        return [r.generated for r in engine.generate(requests)]

    def static_generate():
        clock.begin()
        return [r.generated for r in static.run_to_completion(requests, on_token=clock)]

    runs = {"hf": hf_generate, "mega": mega_generate, "static": static_generate}
    times: dict[str, list[float]] = {name: [] for name in runs}
    outputs = {}
    for repeat in range(args.warmup + args.repeats):  # alternate: all see the same machine load
        for name, run in runs.items():
            seconds, outputs[name] = time_call(run)
            if repeat >= args.warmup:
                times[name].append(seconds)
    tokens = batch * args.new_tokens
    row = {"family": family, "batch": batch}
    for name in runs:
        row[f"{name}_s"] = statistics.median(times[name])
        row[f"{name}_tokens_per_s"] = tokens / row[f"{name}_s"]
    row["mega_speedup"], row["static_speedup"] = row["hf_s"] / row["mega_s"], row["hf_s"] / row["static_s"]
    row["same_tokens"] = outputs["hf"] == outputs["mega"] == outputs["static"]
    limit = batch * args.bandwidth / weight_bytes(engine.model)  # tokens/s if each step only read the weights
    for name in runs:
        row[f"{name}_bandwidth_fraction"] = row[f"{name}_tokens_per_s"] / limit
    row["static_ttft_p50_s"], row["static_ttft_p99_s"] = percentile(clock.first, 0.5), percentile(clock.first, 0.99)
    row["static_itl_p50_s"], row["static_itl_p99_s"] = percentile(clock.gaps, 0.5), percentile(clock.gaps, 0.99)
    if args.profile and args.new_tokens > 1:
        # One decode step's kernels: a whole generation minus a one-token one (the prefill and the
        # first token cancel), over the new_tokens - 1 steps between them.
        first_only = [GenerationRequest(r.prompt, 1) for r in requests]
        short = profile_steps(lambda: static.run_to_completion(first_only), steps=1)
        long = profile_steps(static_generate, steps=1)
        per_step = difference(long, short, args.new_tokens - 1)
        row["decode_kernels"], row["decode_kernels_table"] = as_json(per_step), markdown(per_step)
    return row


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args, directory: str) -> tuple[subprocess.Popen, str]:
    """``mega serve`` on a mega checkpoint of the LLaMA model, ids-as-text tokens (NullTokenizer).
    LLaMA: its random weights make no denormal floats, which the server process would not flush."""
    from mega.core.checkpoint import CheckpointMetadata, write_checkpoint
    from mega.core.tokenizer import TokenizerOptions, TokenizerSpec

    config, weights = mega_weights("llama", hf_model("llama", args))
    write_checkpoint(directory, CheckpointMetadata(0, "llama", dataclasses.asdict(config)), weights,
                     tokenizer=TokenizerSpec("NullTokenizer", TokenizerOptions(vocab_size=args.vocab - 1)))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mega.core.cli.main", "serve", "--load", directory,
                               "--port", str(port), "--log-level", "warning",
                               "--max-batch-size", str(max(args.clients))])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/health").status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("mega serve did not start within 120 s")


async def stream_completion(http: httpx.AsyncClient, body: dict) -> dict:
    """One streamed ``/v1/completions`` request: its latency, time to first token, the gaps
    between later tokens, and the tokens generated (from the usage chunk)."""
    start = time.perf_counter()
    times, generated = [], 0
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                generated = chunk["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in chunk.get("choices", [])):
                times.append(time.perf_counter())
    end = time.perf_counter()
    return {"latency": end - start, "ttft": (times[0] if times else end) - start,
            "gaps": [b - a for a, b in zip(times, times[1:], strict=False)], "generated": generated}


async def prefix_counters(http: httpx.AsyncClient) -> tuple[float, float]:
    """The server's prefix-cache (queried, hit) prompt tokens so far."""
    values = {}
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith(("mega_prefix_cache_queries_total ", "mega_prefix_cache_hits_total ")):
            name, value = line.split()
            values[name] = float(value)
    return values.get("mega_prefix_cache_queries_total", 0.0), values.get("mega_prefix_cache_hits_total", 0.0)


def server_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds so far of the server process ``pid`` and its descendants (torchrun's ranks):
    those of the engine's thread (named ``mega-engine`` for the OS) and those of every other
    thread (HTTP, tokenizing, torch's own). Linux (/proc); elsewhere NaN."""
    if not os.path.isdir(f"/proc/{pid}"):
        return float("nan"), float("nan")
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue  # ended meanwhile
    tree, grew = {pid}, True
    while grew:
        grew = False
        for child, parent in parents.items():
            if parent in tree and child not in tree:
                tree.add(child)
                grew = True
    engine = other = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for process in tree:
        try:
            threads = os.listdir(f"/proc/{process}/task")
        except OSError:
            continue
        for thread in threads:
            try:
                name = open(f"/proc/{process}/task/{thread}/comm").read().strip()
                fields = open(f"/proc/{process}/task/{thread}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            seconds = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            if name == ENGINE_THREAD_OS_NAME:
                engine += seconds
            else:
                other += seconds
    return engine, other


def summary(clients: int, replies: list[dict], wall: float, queried: float, hits: float,
            cpu: tuple[float, float] = (float("nan"), float("nan"))) -> dict:
    """One concurrency level's row; ``cpu``: the server's CPU seconds during it (engine thread, the rest)."""
    latencies = [r["latency"] for r in replies]
    ttfts = [r["ttft"] for r in replies]
    gaps = [gap for r in replies for gap in r["gaps"]]
    generated = sum(r["generated"] for r in replies)
    return {"clients": clients, "requests": len(replies), "tokens_per_s": generated / wall,
            "p50_s": statistics.median(latencies), "p99_s": percentile(latencies, 0.99),
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
            "itl_p50_s": percentile(gaps, 0.5), "itl_p99_s": percentile(gaps, 0.99),
            "prefix_hit_rate": hits / queried if queried else 0.0,
            "engine_cpu_us_per_token": 1e6 * cpu[0] / max(generated, 1),
            "other_cpu_us_per_token": 1e6 * cpu[1] / max(generated, 1)}


async def load(url: str, clients: int, requests_per_client: int, args, pid: int | None = None) -> dict:
    generator = torch.Generator().manual_seed(clients)
    replies: list[dict] = []

    async def client(client_index: int, http: httpx.AsyncClient) -> None:
        for _ in range(requests_per_client):
            prompt = " ".join(map(str, torch.randint(0, args.vocab - 1, (args.prompt,), generator=generator).tolist()))
            replies.append(await stream_completion(http, {"prompt": prompt, "max_tokens": args.server_tokens,
                                                          "temperature": 0}))

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients + 1)) as http:
        queried, hits = await prefix_counters(http)
        cpu = server_cpu_seconds(pid) if pid else (float("nan"),) * 2
        start = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(clients)))
        wall = time.perf_counter() - start
        cpu = tuple(after - before for before, after in zip(cpu, server_cpu_seconds(pid) if pid else cpu, strict=True))
        queried_after, hits_after = await prefix_counters(http)
    return summary(clients, replies, wall, queried_after - queried, hits_after - hits, cpu)


SERVER_HEADER = (f"{'clients':>8}{'requests':>10}{'tok/s':>9}{'p50 s':>9}{'p99 s':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
                 f"{'ITL p50':>9}{'ITL p99':>9}{'prefix hits':>13}{'CPU us/token: engine':>22}{'other':>7}")


def server_line(r: dict) -> str:
    """One row of the server table (latencies in seconds, the hit rate in % of prompt tokens)."""
    return (f"{r['clients']:>8}{r['requests']:>10}{r['tokens_per_s']:>9.1f}{r['p50_s']:>9.3f}{r['p99_s']:>9.3f}"
            f"{r['ttft_p50_s']:>10.3f}{r['ttft_p99_s']:>10.3f}{r['itl_p50_s']:>9.4f}{r['itl_p99_s']:>9.4f}"
            f"{100 * r['prefix_hit_rate']:>12.1f}%{r['engine_cpu_us_per_token']:>22.0f}{r['other_cpu_us_per_token']:>7.0f}")


def bench_server(args) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="mega-bench-generate-") as directory:
        server, url = start_server(args, directory)
        try:
            asyncio.run(load(url, 1, 2, args))  # warm-up
            return [asyncio.run(load(url, clients, max(2, args.server_requests // clients), args, server.pid))
                    for clients in args.clients]
        finally:
            server.terminate()
            server.wait(timeout=30)


def main() -> None:
    # Random GPT-2 weights drive some activations into denormal floats, which slow x86 CPUs
    # about tenfold, Hugging Face and mega alike; trained weights rarely do. Flushed for both.
    torch.set_flush_denormal(True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["gpt", "llama", "both"], default="both")
    parser.add_argument("--device", default="cpu", help="engine part: cpu or cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="engine part: both models' dtype")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt (engine part)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--server-requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--server-tokens", type=int, default=32, help="tokens generated per server request")
    parser.add_argument("--no-server", action="store_true", help="only the engine part")
    parser.add_argument("--read-lag", type=int, default=None,
                        help=f"steps between choosing tokens on the device and reading them on the host (default "
                             f"{READ_LAG} on a GPU, 0 on the CPU; 0 reads every step at once, a host synchronisation "
                             "per token)")
    parser.add_argument("--compile", action="store_true",
                        help="the static path's decode step through torch.compile (inductor), as mega generate "
                             "--compile; the warm-up call compiles it")
    parser.add_argument("--profile", action="store_true",
                        help="the static path's kernels per decode step (torch profiler; CPU operators on a CPU): "
                             "counts and time by kernel and category")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    args.bandwidth = measure_bandwidth(args.device)
    families = ["gpt", "llama"] if args.family == "both" else [args.family]
    engine_rows = [bench_engine(family, batch, args) for family in families for batch in args.batches]
    server_rows = [] if args.no_server else bench_server(args)
    if args.json:
        print(json.dumps({"args": vars(args), "threads": torch.get_num_threads(), "engine": engine_rows,
                          "server": server_rows}, indent=2))
        return
    print(f"layers {args.layers}, hidden {args.hidden}, heads {args.heads}, vocab {args.vocab}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, greedy, {args.dtype} on {args.device}, {torch.get_num_threads()} threads; "
          f"median of {args.repeats}; measured bandwidth {args.bandwidth / 1e9:.1f} GB/s")
    print(f"{'family':<7}{'batch':>6}{'HF s':>9}{'mega s':>9}{'static s':>10}{'HF tok/s':>10}{'mega tok/s':>12}"
          f"{'static tok/s':>14}{'mega/HF':>9}{'static/HF':>11}  same tokens")
    for r in engine_rows:
        print(f"{r['family']:<7}{r['batch']:>6}{r['hf_s']:>9.3f}{r['mega_s']:>9.3f}{r['static_s']:>10.3f}"
              f"{r['hf_tokens_per_s']:>10.1f}{r['mega_tokens_per_s']:>12.1f}{r['static_tokens_per_s']:>14.1f}"
              f"{r['mega_speedup']:>8.2f}x{r['static_speedup']:>10.2f}x  {r['same_tokens']}")
    print(f"\n{'family':<7}{'batch':>6}{'HF %BW':>8}{'mega %BW':>10}{'static %BW':>12}{'TTFT p50 ms':>13}"
          f"{'ITL p50 ms':>12}{'ITL p99 ms':>12}   (static path; %BW: of the memory-bandwidth limit)")
    for r in engine_rows:
        print(f"{r['family']:<7}{r['batch']:>6}{100 * r['hf_bandwidth_fraction']:>8.1f}"
              f"{100 * r['mega_bandwidth_fraction']:>10.1f}{100 * r['static_bandwidth_fraction']:>12.1f}"
              f"{1e3 * r['static_ttft_p50_s']:>13.2f}{1e3 * r['static_itl_p50_s']:>12.2f}{1e3 * r['static_itl_p99_s']:>12.2f}")
    for r in engine_rows:
        if "decode_kernels_table" in r:
            print(f"\nkernels per decode step, {r['family']} batch {r['batch']} (static path):\n"
                  f"{r['decode_kernels_table']}")
    if server_rows:
        print(f"\nmega serve (llama, separate process), /v1/completions: prompt {args.prompt} tokens, "
              f"{args.server_tokens} generated, greedy")
        print(SERVER_HEADER)
        for r in server_rows:
            print(server_line(r))


if __name__ == "__main__":
    main()
