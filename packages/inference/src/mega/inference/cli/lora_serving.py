"""``mega serve``'s LoRA adapters chosen per request: the flags (vLLM's names), and wrapping the
loaded base so every row of a batch takes its own adapter (:mod:`mega.models.lora.multi`), with the
``--lora-modules`` loaded in (:class:`~mega.inference.engine.lora_registry.AdapterRegistry`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_MAX_LORA_RANK = 16  # vLLM's


def lora_module(value: str) -> tuple[str, str, str | None]:
    """``NAME=DIR`` or vLLM's JSON ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
            name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
        except (ValueError, KeyError, TypeError) as error:
            raise argparse.ArgumentTypeError(f"{value}: not JSON with a name and a path ({error})") from None
    else:
        name, equals, path = value.partition("=")
        base = None
        if not equals:
            raise argparse.ArgumentTypeError(f"{value}: give NAME=DIR (or JSON with name and path)")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"{value}: the name and the directory must not be empty")
    if not Path(path).exists():
        raise argparse.ArgumentTypeError(f"{value}: {path}: no such file or directory")
    return name, path, base


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters chosen per request (vLLM's flags)")
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters beside the base, each request choosing one by its model (implied by "
                            "--lora-modules); one batch mixes adapters and the base, each row its own")
    group.add_argument("--lora-modules", nargs="+", type=lora_module, default=[], metavar="NAME=DIR",
                       help="adapters to serve, each NAME=DIR or JSON {\"name\": ..., \"path\": ...}: DIR a LoRA run's "
                            "mega checkpoint (trained on this base: its recorded weights fingerprint must match) or a "
                            "PEFT adapter directory; requests name it as their model, /v1/models lists it")
    group.add_argument("--max-loras", type=int, default=None, metavar="N",
                       help="adapters served at once (slots allocated at start; default: the --lora-modules given, "
                            "at least 1)")
    group.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                       help=f"the largest adapter rank (smaller ones are padded with zeros to it; a PEFT adapter of "
                            f"separate q/k/v modules counts their ranks summed); default: the largest of "
                            f"--lora-modules, at least {DEFAULT_MAX_LORA_RANK}")
    group.add_argument("--allow-runtime-lora-updates", action="store_true",
                       help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING), behind the API key; one rank only (not under "
                            "torchrun's tensor parallelism)")


def serve_adapters(args: argparse.Namespace, engine, loaded, groups):
    """The adapters' registry with ``--lora-modules`` loaded, the engine's model wrapped for them;
    None without ``--enable-lora``/``--lora-modules``. Raises ``ValueError`` naming the problem."""
    modules = getattr(args, "lora_modules", None) or []
    if not modules and not getattr(args, "enable_lora", False):
        if any(getattr(args, flag, None) for flag in ("allow_runtime_lora_updates", "max_loras", "max_lora_rank")):
            raise ValueError("--allow-runtime-lora-updates, --max-loras and --max-lora-rank need --enable-lora or "
                             "--lora-modules")
        return None
    # start-up cost: the LoRA serving code is imported only when adapters are served
    from mega.core.checkpoint import CheckpointError, checkpoint_and_metadata
    from mega.core.checkpoint.adapter_record import weights_fingerprint
    from mega.core.plugins import get_plugins
    from mega.inference.engine.encoder_decoder import is_encoder_decoder
    from mega.inference.engine.lora_registry import AdapterRegistry
    from mega.models.lora.adapter_files import read_adapter
    from mega.models.lora.multi import adaptable_weight_shapes, apply_multi_lora

    if is_encoder_decoder(engine.model):
        raise ValueError("--lora-modules serves decoder-only models (not an encoder-decoder's batches)")
    if getattr(args, "adapter", None) or loaded.base_name is not None:
        raise ValueError("--adapter (or --load of a LoRA checkpoint alone) merges one adapter into the served "
                         "weights, --lora-modules serves adapters of the base beside it: give one of them")
    base_name = args.served_model_name or loaded.name
    names = [name for name, _, _ in modules]
    if len(set(names)) != len(names) or base_name in names:
        raise ValueError(f"--lora-modules: the names {', '.join(names)} must differ from each other and from the "
                         f"base's {base_name!r}")
    for name, _, base in modules:
        if base is not None and base != base_name:
            raise ValueError(f"--lora-modules {name}: base_model_name {base!r} is not the served base {base_name!r}")
    family = get_plugins().models.get(loaded.family_name)
    fingerprint = None
    if not (Path(args.load) / "config.json").is_file():
        try:
            fingerprint = weights_fingerprint(checkpoint_and_metadata(args.load, checksums=False)[1])
        except CheckpointError:
            pass

    def read(path: str):
        return read_adapter(path, family, loaded.config, shapes, fingerprint, args.load)

    shapes = adaptable_weight_shapes(loaded.model)
    adapters = []  # read first: their ranks size the stacks
    for name, path, _ in modules:
        try:
            adapters.append((name, path, read(path)))
        except ValueError as error:
            raise ValueError(f"--lora-modules {name}={path}: {error}") from None
    max_rank = args.max_lora_rank or max([DEFAULT_MAX_LORA_RANK, *(a.rank for _, _, a in adapters)])
    if args.allow_runtime_lora_updates and groups.tp.size > 1:
        raise ValueError("--allow-runtime-lora-updates runs on one rank: under tensor parallelism serve the "
                         "--lora-modules given at the start")
    lora = apply_multi_lora(loaded.model, args.max_loras or max(len(modules), 1), max_rank)
    registry = AdapterRegistry(lora, read, args.allow_runtime_lora_updates)
    for name, path, weights in adapters:
        try:
            registry.load(name, path, weights=weights)
        except ValueError as error:
            raise ValueError(f"--lora-modules {name}={path}: {error}") from None
    engine.lora = lora
    return registry

