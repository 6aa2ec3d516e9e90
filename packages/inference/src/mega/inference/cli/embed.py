"""``mega embed``: embed the inputs of a JSON-lines file with an encoder model; and the
embeddings side of ``mega serve`` (an encoder checkpoint serves ``POST /v1/embeddings``).

Each input line is a JSON string, a list of token ids, or an object with ``"text"`` (a string)
or ``"ids"`` (token ids); each output line is ``{"index": i, "embedding": [...]}``, in input
order. Every line is read and checked before anything is computed, and the output appears
(renamed from a temporary file) only when complete: a bad line is one error naming the file
and line, and leaves no output behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from mega.core.cli.argparser import CommandParser
from mega.inference.cli.load_arguments import add_load_arguments

# The capability a model family declares (ModelFamily.features) when its models give embeddings.
EMBEDDINGS_FEATURE = "embeddings"
DEFAULT_BATCH_SIZE = 32  # inputs per forward pass


def add_embedding_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("embeddings (encoder models, e.g. the bert family)")
    group.add_argument("--pooling", choices=["mean", "cls"], default="mean",
                       help="mean: average of the real tokens' last hidden states (default); cls: the first token's")
    group.add_argument("--no-normalize", dest="normalize", action="store_false",
                       help="return the pooled vectors as they are (default: scaled to unit L2 norm)")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="mega embed",
        description="Embed texts or token ids with an encoder model (a mega checkpoint or a Hugging Face "
                    "directory of the bert family) and write one JSON line per input.",
    )
    add_load_arguments(parser)
    add_embedding_arguments(parser)
    group = parser.add_argument_group("input and output")
    group.add_argument("--input", required=True, metavar="FILE",
                       help='JSON lines: a string, a list of token ids, or {"text": ...} / {"ids": [...]}')
    group.add_argument("--output", metavar="FILE", help="where to write the embeddings (default: stdout)")
    group.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                       help=f"inputs per forward pass (default {DEFAULT_BATCH_SIZE})")
    return parser


def read_inputs(path: Path) -> list:
    """The inputs of a JSON-lines file, each a string or a list of token ids."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ValueError(f"--input {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--input {path} is not UTF-8 text") from None
    inputs = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if isinstance(item, dict):
            item = item.get("text", item.get("ids"))
        if not (isinstance(item, str) or (isinstance(item, list) and item
                                          and all(isinstance(t, int) and not isinstance(t, bool) for t in item))):
            raise ValueError(f'{path}:{number}: expected a string, a list of token ids, or {{"text": ...}} / '
                             '{"ids": [...]}')
        inputs.append((number, item))
    if not inputs:
        raise ValueError(f"--input {path} holds no inputs")
    return inputs


def load_embedder(args: argparse.Namespace, command: str, batch_size: int):
    """The model of ``--load`` as an :class:`~mega.inference.embeddings.Embedder` (one process)."""
    # start-up cost: `mega --help` and the parser stay free of torch and the models
    from mega.core.checkpoint import CheckpointError
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.inference.embeddings import Embedder
    from mega.inference.loader import LoadError, load_from_args

    try:
        loaded = load_from_args(args, ParallelGroups(ParallelConfig()))
        if loaded.quantized is not None:
            print(f"mega {command}: {loaded.quantized.describe()}", file=sys.stderr, flush=True)
        embedder = Embedder(loaded.model, loaded.tokenizer, loaded.max_positions, loaded.config.vocab_size,
                            pooling=args.pooling, normalize=args.normalize, batch_size=batch_size)
    except (LoadError, CheckpointError, ValueError) as error:
        raise SystemExit(f"mega {command}: error: {error}") from None
    return embedder, loaded


def is_encoder_checkpoint(path: str) -> bool:
    """Whether the checkpoint at ``path`` is of a family that gives embeddings (read from its
    config, before any weight is loaded)."""
    # start-up cost, as above
    from mega.core.plugins import get_plugins

    plugins = get_plugins()
    try:
        if (Path(path) / "config.json").is_file():
            # start-up cost, as above
            from mega.inference.loader import _open_hugging_face

            with _open_hugging_face(Path(path), plugins) as source:
                family_name = source.family
        else:
            # start-up cost, as above
            from mega.core.checkpoint import checkpoint_and_metadata

            family_name = checkpoint_and_metadata(Path(path))[1].model_family
    except Exception:  # noqa: BLE001 - loading it again reports the problem in the command's words
        return False
    return family_name in plugins.models and EMBEDDINGS_FEATURE in plugins.models.get(family_name).features


def serve_embeddings(args: argparse.Namespace) -> int:
    """``mega serve`` on an encoder: ``POST /v1/embeddings`` (and ``GET /v1/health``)."""
    # start-up cost, as above
    import uvicorn

    from mega.inference.http.embeddings_api import create_embeddings_app

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("mega serve: error: an encoder's embeddings are served by one process; start it "
                         "without torchrun")
    embedder, loaded = load_embedder(args, "serve", args.max_batch_size or DEFAULT_BATCH_SIZE)
    app = create_embeddings_app(embedder, loaded.name, api_key=args.api_key, max_body_bytes=args.max_request_bytes)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")  # exit 2, as argparse's
    try:
        numbered = read_inputs(Path(args.input))
    except ValueError as error:
        raise SystemExit(f"mega embed: error: {error}") from None
    embedder, _ = load_embedder(args, "embed", args.batch_size)
    # start-up cost, as above
    from mega.inference.embeddings import EmbeddingInputError

    try:
        sequences = embedder.token_ids([item for _, item in numbered])
    except EmbeddingInputError as error:
        line = numbered[error.index][0]
        message = str(error).replace(f"input[{error.index}]", f"{args.input}:{line}")
        raise SystemExit(f"mega embed: error: {message}") from None
    start = time.perf_counter()
    vectors = embedder.embed(sequences)
    seconds = time.perf_counter() - start
    lines = "".join(json.dumps({"index": i, "embedding": vector.tolist()}) + "\n" for i, vector in enumerate(vectors))
    if args.output:
        _write_atomically(Path(args.output), lines)
    else:
        sys.stdout.write(lines)
    print(f"mega embed: {len(vectors)} inputs in {seconds:.2f} s ({len(vectors) / max(seconds, 1e-9):.1f} "
          "embeddings/s)", file=sys.stderr)
    return 0


def _write_atomically(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        staging.write_text(text, encoding="utf-8")
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
