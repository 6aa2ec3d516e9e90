"""A run's parallel layout and data-parallel strategy in one line: what a run's first lines and
``mega checkpoint info`` say (from the layout a checkpoint records, ``checkpointer.layout_of``).
Torch-free, so ``mega checkpoint info`` stays quick."""

from __future__ import annotations

# What each strategy is usually called, as a run's first lines and `mega checkpoint info` say it.
STRATEGY_NAMES = {"no_shard": "DDP", "optim": "ZeRO-1 (distributed optimizer)", "optim_grads": "ZeRO-2 (FSDP2)",
                  "optim_grads_params": "ZeRO-3 (FSDP2)"}


def strategy_name(strategy: str, replicas: int = 1) -> str:
    """``DDP``, ``ZeRO-1 (distributed optimizer)``, ``ZeRO-2 (FSDP2)``, ``ZeRO-3 (FSDP2)``, or HSDP."""
    if replicas > 1:  # only FSDP's strategies replicate (mega.core.parallel.fsdp_config refuses the others)
        return f"HSDP ({STRATEGY_NAMES[strategy]} within each of {replicas} replicas)"
    return STRATEGY_NAMES.get(strategy, strategy)


def layout_text(layout: dict) -> str:
    """One line for a layout as :func:`mega.train.checkpoint.checkpointer.layout_of` records it."""
    sizes = " x ".join(f"{key} {layout.get(key, 1)}" for key in ("tp", "cp", "ep", "dp", "pp"))
    extras = [f"vpp {layout['vpp']}" if layout.get("vpp", 1) > 1 else "",
              "sequence parallel" if layout.get("sequence_parallel") else ""]
    strategy = layout.get("data_parallel_strategy") or ("optim" if layout.get("distributed_optimizer") else "no_shard")
    return (f"{layout.get('world_size', '?')} ranks = {sizes}{''.join(', ' + e for e in extras if e)}; "
            f"data parallelism: {strategy_name(strategy, layout.get('data_parallel_replicas', 1))}")
