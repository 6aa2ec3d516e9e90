"""``mega serve``: the REST text-generation server (FastAPI on uvicorn).

Under ``torchrun --nproc-per-node N`` the model is tensor-parallel over the N ranks: rank 0
serves HTTP and hands every engine batch to the other ranks, which follow until it stops.
"""

from __future__ import annotations

import argparse
import os

from mega.core.cli.argparser import CommandParser
from mega.inference.embed_cli import add_embedding_arguments, is_encoder_checkpoint, serve_embeddings
from mega.inference.load_arguments import add_decoding_arguments, add_load_arguments, compile_backend


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="mega serve",
        description="Serve a mega checkpoint or a Hugging Face model directory over HTTP: Megatron's "
                    "PUT /api, OpenAI-style POST /v1/completions (streaming too), GET /v1/health; an encoder "
                    "(bert family) serves OpenAI-style POST /v1/embeddings instead; "
                    "the API's schema is browsable at /docs.",
    )
    add_load_arguments(parser)
    add_embedding_arguments(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes it)")
    group.add_argument("--port", type=int, default=5000, help="port (default 5000)")
    group.add_argument("--api-key", default=os.environ.get("MEGA_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (the scheme in any case) on every route but /health "
                            "and /v1/health, /docs and /openapi.json included, checked before the body is read "
                            "(default: the MEGA_API_KEY environment variable, else no key; an empty key is refused)")
    group.add_argument("--max-model-len", type=int, default=None, metavar="N",
                       help="the longest sequence (prompt and generated tokens) a request may ask for, at most the "
                            "model's positions (default: the model's positions); also what a static KV cache slot "
                            "holds")
    group.add_argument("--max-request-bytes", type=int, default=4 << 20, metavar="BYTES",
                       help="a request body larger than this is refused with 413, by the generation and the "
                            "embeddings server alike (default 4 MiB)")
    group.add_argument("--max-num-queued-reqs", type=int, default=None, metavar="N",
                       help="vLLM's flag: sequences (prompts x n or best_of) waiting or running at most; a request "
                            "that would go past it gets 429 with Retry-After at once (default: no bound)")
    group.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                       help="a request not answered within this is cancelled and gets 408 (default: no limit)")
    group.add_argument("--max-batch-size", type=int, default=32,
                       help="sequences the engine runs together; concurrent requests share batches (default 32)")
    group.add_argument("--batching", choices=["continuous", "lockstep"], default="continuous",
                       help="continuous (default): a new request joins the running batch at the next step, its KV "
                            "cache in blocks (or static slots); lockstep: batches run to their end, as Megatron's "
                            "(always for encoder-decoder models)")
    group.add_argument("--max-num-tokens", type=int, default=None, metavar="N",
                       help="continuous batching: tokens the KV cache holds for all running sequences together; a "
                            "request is admitted once its prompt and max tokens fit (default: --max-batch-size "
                            "times the model's positions); with the static KV cache, a slot of the model's "
                            "positions per sequence")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="continuous batching: keep the KV cache of prompts' full 16-token blocks, keyed by "
                            "the hash of their prefix, for later prompts that start the same (those prefill only "
                            "the rest): the paged cache shares the blocks (least recently used evicted when room "
                            "is needed), the static cache copies them from the slot that holds them (kept until "
                            "the slot is taken). Default: on")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                       help="continuous batching: tokens one engine step computes at most (one per decoding "
                            "sequence, the rest prompt tokens), so long prompts are prefilled in chunks between "
                            "decode steps; at least --max-batch-size (default: each prompt prefilled whole)")
    add_decoding_arguments(group, "with continuous batching (the paged cache's place; by default without "
                                  "--max-num-tokens; tensor-parallel too) and, when asked, with lock-step "
                                  "batches; decoder-only models")
    group.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level")
    return parser


def static_kv_cache(args: argparse.Namespace, device, lockstep: bool, decoder_only: bool = True) -> bool:
    """Whether the server decodes on the static KV cache: as asked, else on CUDA under continuous
    batching (tensor-parallel too) unless ``--max-num-tokens`` sizes a paged cache. Lock-step
    batches use it only when asked."""
    # start-up cost: `mega --help` and the parser stay free of torch and the models
    from mega.inference.static_decode import static_kv_cache_wanted

    requested = args.static_kv_cache
    if requested is None and (args.max_num_tokens is not None or lockstep):
        requested = False
    return static_kv_cache_wanted(requested, device, decoder_only, "for decoder-only models")


def lockstep_generate(args: argparse.Namespace, engine, lockstep: bool = True):
    """How lock-step batches generate, on the leader and the followers alike: the static KV
    cache's decoder where it is on, else the engine."""
    # start-up cost, as above
    from mega.inference.encoder_decoder import is_encoder_decoder
    from mega.inference.static_decode import StaticDecoder

    if static_kv_cache(args, engine.device, lockstep, not is_encoder_decoder(engine.model)):
        return StaticDecoder(engine, use_cuda_graphs=args.cuda_graphs and engine.device.type == "cuda",
                             compile_backend=compile_backend(args)).generate
    return engine.generate


def uses_lockstep(args: argparse.Namespace, engine) -> bool:
    """Lock-step batches where asked, and for encoder-decoder models (T5: their own engine, no
    paged cache); continuous batching otherwise, tensor-parallel or not."""
    # start-up cost, as above
    from mega.inference.encoder_decoder import is_encoder_decoder

    return args.batching == "lockstep" or is_encoder_decoder(engine.model)


def continuous_worker(args: argparse.Namespace, engine, static: bool):
    """The continuous-batching worker, built alike on the leader and on every follower."""
    # start-up cost, as above
    from mega.inference.continuous import ContinuousBatchingWorker

    return ContinuousBatchingWorker(engine, args.max_batch_size, args.max_num_tokens, static_cache=static,
                                    use_cuda_graphs=args.cuda_graphs and engine.device.type == "cuda",
                                    prefix_caching=args.enable_prefix_caching is not False,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    compile_backend=compile_backend(args) if static else None)


def follow_serving(args: argparse.Namespace, engine) -> None:
    """A follower rank's whole part in ``mega serve`` under torchrun: the leader's continuous
    batching steps, or its lock-step batches, until it stops. A setting the leader refuses (it
    says why) only makes the follower wait for the leader's end."""
    # start-up cost, as above
    from mega.inference.encoder_decoder import is_encoder_decoder
    from mega.inference.engine import GenerationError
    from mega.inference.tp_serving import follow

    lockstep = uses_lockstep(args, engine)
    try:
        static = static_kv_cache(args, engine.device, lockstep, not is_encoder_decoder(engine.model))
        if not lockstep:
            continuous_worker(args, engine, static).follow()
            return
        generate = lockstep_generate(args, engine)
    except (GenerationError, ValueError):
        generate = None
    follow(engine, engine.tp_group, generate)


def check_web_stack() -> None:
    """Import the server's web stack before the model loads, so a missing package ends ``mega
    serve`` at once with what to install (fastapi 0.165 imports ``opentelemetry`` in
    ``fastapi.applications`` and ``fastapi.routing``: it needs ``opentelemetry-api`` however it
    is used, which a hand-made set of wheels easily lacks)."""
    try:
        # start-up cost, as above
        import mega.inference.http.server  # noqa: F401
    except ModuleNotFoundError as error:
        raise SystemExit(f"mega serve: error: the server needs the Python package '{error.name}' ({error}); "
                         "install mega-inference with pip (which resolves fastapi's own dependencies, "
                         "opentelemetry-api included) or add it") from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.api_key is not None and not args.api_key.strip():
        raise SystemExit("mega serve: error: the API key (--api-key or MEGA_API_KEY) is empty, which would serve "
                         "without one: give a key, or leave both out to serve without a key")
    for flag in ("max_batch_size", "max_num_tokens", "max_model_len", "max_request_bytes", "request_timeout",
                 "max_num_batched_tokens", "max_num_queued_reqs"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise SystemExit(f"mega serve: error: --{flag.replace('_', '-')} must be positive, got {value}")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < args.max_batch_size:
        parser.error(f"--max-num-batched-tokens {args.max_num_batched_tokens} must be at least --max-batch-size "
                     f"{args.max_batch_size} (every running sequence decodes a token per step)")
    check_web_stack()
    if is_encoder_checkpoint(args.load):  # an encoder serves POST /v1/embeddings instead
        return serve_embeddings(args)
    # start-up cost, as above
    import uvicorn

    from mega.inference.batching import BatchingWorker
    from mega.inference.encoder_decoder import is_encoder_decoder
    from mega.inference.engine import GenerationError
    from mega.inference.engine_setup import setup_engine
    from mega.inference.http.server import create_app
    from mega.inference.http.service import InferenceService
    from mega.inference.tp_serving import lead

    setup = setup_engine(args, "serve", follower=lambda engine: follow_serving(args, engine))
    if setup is None:  # a follower: the leader has stopped serving
        return 0
    lockstep = uses_lockstep(args, setup.engine)
    try:
        static = static_kv_cache(args, setup.engine.device, lockstep, not is_encoder_decoder(setup.engine.model))
    except GenerationError as error:
        lead(None, setup.tp_group)  # the other ranks stop following
        raise SystemExit(f"mega serve: error: {error}") from None
    if lockstep and (args.enable_prefix_caching or args.max_num_batched_tokens is not None):
        lead(None, setup.tp_group)
        raise SystemExit("mega serve: error: --enable-prefix-caching and --max-num-batched-tokens run with continuous "
                         "batching (a decoder-only model), not lock-step batches")
    if not lockstep:
        worker = continuous_worker(args, setup.engine, static)
    else:
        worker = BatchingWorker(setup.engine, args.max_batch_size,
                                before_batch=lambda requests: lead(requests, setup.tp_group),
                                generate=lockstep_generate(args, setup.engine) if static else None)
    service = InferenceService(setup.engine, worker, setup.loaded.tokenizer, setup.loaded.name,
                               chat_template=setup.loaded.chat_template, request_timeout=args.request_timeout,
                               max_queued_sequences=args.max_num_queued_reqs)
    worker.start()
    try:
        uvicorn.run(create_app(service, api_key=args.api_key, max_body_bytes=args.max_request_bytes), host=args.host, port=args.port,
                    log_level=args.log_level)
    finally:
        worker.stop()
        lead(None, setup.tp_group)
    return 0
