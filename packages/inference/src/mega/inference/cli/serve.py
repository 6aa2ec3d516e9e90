"""``mega serve``: the REST text-generation server (FastAPI on uvicorn).

Every route submits to the engine's one loop (continuous batching; T5's batches of encoded
prompts). Under ``torchrun --nproc-per-node N`` the model is tensor-parallel over the N ranks:
rank 0 serves HTTP and hands every step's admitted requests to the other ranks, which follow
until it stops.
"""

from __future__ import annotations

import argparse
import os

from mega.core.cli.argparser import CommandParser
from mega.inference.cli.embed import add_embedding_arguments, is_encoder_checkpoint, serve_embeddings
from mega.inference.cli.load_arguments import add_decoding_arguments, add_load_arguments
from mega.inference.cli.lora_serving import add_lora_arguments


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="mega serve",
        description="Serve a mega checkpoint or a Hugging Face model directory over HTTP: Megatron's "
                    "PUT /api, OpenAI-style POST /v1/completions (streaming too), GET /v1/health; an encoder "
                    "(bert family) serves OpenAI-style POST /v1/embeddings instead; LoRA adapters served beside the "
                    "base are chosen per request by model (--lora-modules); "
                    "the API's schema is browsable at /docs.",
    )
    add_load_arguments(parser)
    add_embedding_arguments(parser)
    add_lora_arguments(parser)
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
    group.add_argument("--reasoning-parser", choices=("deepseek_r1", "qwen3"), default=None,
                       help="chat answers' <think>...</think> text goes to reasoning_content (on without the flag "
                            "where the chat template writes <think> itself)")
    group.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                       help="a request not answered within this is cancelled and gets 408 (default: no limit)")
    group.add_argument("--max-batch-size", type=int, default=32,
                       help="sequences the engine runs together; concurrent requests share batches (default 32)")
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
                            "the slot is taken). Default: on, but off on the paged cache of a model with sliding-window "
                            "layers (which keep only their window's keys there)")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                       help="continuous batching: tokens one engine step computes at most (one per decoding "
                            "sequence, the rest prompt tokens), so long prompts are prefilled in chunks between "
                            "decode steps; at least --max-batch-size (default: each prompt prefilled whole)")
    add_decoding_arguments(group, "the paged cache's place (by default without --max-num-tokens; "
                                  "tensor-parallel too); decoder-only models")
    group.add_argument("--served-model-name", metavar="NAME",
                       help="the model's name in the API (requests' model, /v1/models); default: the --adapter's "
                            "directory name, else --load's")
    group.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level")
    return parser


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
                 "max_num_batched_tokens", "max_num_queued_reqs", "max_loras", "max_lora_rank"):
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

    from mega.inference.cli.engine_setup import setup_engine
    from mega.inference.engine.tp_serving import lead
    from mega.inference.http.server import create_app
    from mega.inference.http.service import InferenceService

    setup = setup_engine(args, "serve")
    if setup is None:  # a follower: the leader has stopped serving
        return 0
    worker = setup.worker
    loaded = setup.loaded
    service = InferenceService(setup.engine, worker, loaded.tokenizer, args.served_model_name or loaded.name,
                               base_model_name=loaded.base_name, chat_template=loaded.chat_template,
                               request_timeout=args.request_timeout, max_queued_sequences=args.max_num_queued_reqs,
                               reasoning_parser=args.reasoning_parser, adapters=setup.adapters)
    worker.start()
    try:
        app = create_app(service, api_key=args.api_key, max_body_bytes=args.max_request_bytes)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        worker.stop()
        lead(None, setup.tp_group)
    return 0
