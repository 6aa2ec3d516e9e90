"""`mega train --model-family mixtral` at expert-parallel layouts computes what one process computes.

A 2-layer, 4-expert, top-2 model trains 5 steps on Megatron's mock data in fp32 with the
load-balancing and z-losses on (they shape the gradients, so a wrong aux-loss gradient shows in
the later losses). On one world of 4 gloo ranks: ep4 (allgather), tp2 x ep2 with sequence
parallelism (alltoall), ep2 x pp2 with the distributed optimizer, and with capacity-factor
routing (tokens dropped) ep2 (alltoall, padded to capacity) and ep4 (allgather); the losses equal
the one-process run's within 1e-5 (relative) at every step. So do tp2 x ep2 with the experts not
tensor-split (--expert-tensor-parallel-size 1, sequence parallel, distributed optimizer: the
experts' gradients reduced and sharded over their own data-parallel group) and tp2 x etp1 x ep4
(experts spread over the tensor ranks too). The tp2 x ep2 run saves at step 3, and that
checkpoint resumes at ep1 and at ep4 with the uninterrupted run's next losses; the etp1 run's
checkpoint (global shapes) resumes at tp2 x ep2 with the experts tensor-split.

No checkpoint is loaded before the first loss, so equal first losses mean equal initial weights;
the initialisation test checks them directly, bit for bit: every family with experts, built at
ep2, ep4, tp2 x ep2 and tp2 x etp1 x ep2/ep4 on the same world, assembles to one process's model.
"""

from __future__ import annotations

import torch

from mega.train.testing.training_runs import assert_losses_close, train_losses

COMMON = [
    "--mock-data", "--model-family", "mixtral", "--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "32",
    "--ffn-hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "16",
    "--vocab-size", "90", "--make-vocab-size-divisible-by", "32", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--train-iters", "5", "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "0",
    "--log-interval", "100", "--seed", "7", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
]
CAPACITY = ["--moe-expert-capacity-factor", "1.0"]
ALLGATHER = ["--moe-token-dispatcher-type", "allgather"]
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
LAYOUTS = {  # name -> (extra flags, uses capacity)
    "ep4 allgather": (["--expert-model-parallel-size", "4", *ALLGATHER], False),
    "tp2 x ep2 sp alltoall": (["--tensor-model-parallel-size", "2", "--sequence-parallel",
                               "--expert-model-parallel-size", "2", *ALLTOALL], False),
    "ep2 x pp2 alltoall": (["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", *ALLTOALL],
                           False),
    "ep2 allgather distributed optimizer": (["--expert-model-parallel-size", "2", *ALLGATHER,
                                             "--use-distributed-optimizer"], False),
    "ep2 alltoall capacity padded distributed optimizer": (
        ["--expert-model-parallel-size", "2", *CAPACITY, *ALLTOALL, "--moe-pad-expert-input-to-capacity",
         "--use-distributed-optimizer"], True),
    "ep4 allgather capacity": (["--expert-model-parallel-size", "4", *ALLGATHER, *CAPACITY], True),
    "tp2 x etp1 x ep2 sp alltoall distributed optimizer": (
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
         "--expert-model-parallel-size", "2", *ALLTOALL, "--use-distributed-optimizer"], False),
    "tp2 x etp1 x ep4 sp allgather": (["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                       "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "4",
                                       *ALLGATHER], False),
}
SAVED = {"tp2 x ep2 sp alltoall": "tp2-ep2", "tp2 x etp1 x ep2 sp alltoall distributed optimizer": "etp1"}
RESUMED = {  # (saved by, layout)
    "ep1": ("tp2-ep2", []), "ep4": ("tp2-ep2", ["--expert-model-parallel-size", "4"]),
    "tp2 x ep2 (etp2) distributed optimizer": ("etp1", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                         "--expert-model-parallel-size", "2",
                                                         "--use-distributed-optimizer"]),
}


def test_expert_parallel_layouts_match_one_process(worlds, tmp_path):
    dropless, capacity = train_losses(COMMON), train_losses(COMMON + CAPACITY)
    assert dropless[-1] < dropless[0], "the tiny model should learn the mock data"
    assert dropless != capacity, "capacity 1.0 should drop tokens and change the losses"

    for name, (extra, uses_capacity) in LAYOUTS.items():  # one call per run: each within the world's timeout
        saving = ["--save", str(tmp_path / SAVED[name]), "--save-interval", "3"] if name in SAVED else []
        ranks = worlds.run(4, train_losses, COMMON + extra + saving)
        assert all(losses == ranks[0] for losses in ranks), name
        assert_losses_close(ranks[0], capacity if uses_capacity else dropless, name)
    for name, (saved_by, extra) in RESUMED.items():
        ranks = worlds.run(4, train_losses, COMMON + extra + ["--load", str(tmp_path / saved_by / "iter_0000003")])
        assert_losses_close(ranks[0], dropless[3:], f"resumed at {name} from {saved_by}")


# -- initialisation: every expert layout starts from one process's weights ---------------------
# Every family that declares experts ("moe"), so a new one is checked as it registers. Each layout
# is (tp, ep, etp, sequence parallel) on the 4-rank world; a row block of 3 rows straddles the
# expert-parallel shards' boundary (4 experts, 2 per rank) and the tensor-parallel ones of dense rows.
INIT_LAYOUTS = {"ep2": (1, 2, None, False), "ep4": (1, 4, None, False), "tp2 x ep2 sp": (2, 2, None, True),
                "tp2 x etp1 x ep2 sp": (2, 2, 1, True), "tp2 x etp1 x ep4 sp": (2, 4, 1, True)}
INIT_SEED = 5


def moe_families() -> list[str]:
    from mega.core.plugins import get_plugins

    models = get_plugins().models
    return sorted(name for name in models.names() if "moe" in models.get(name).features)


def _tiny_config(family):
    import dataclasses

    return dataclasses.replace(family.presets["tiny"], vocab_size=256, make_vocab_size_divisible_by=64)


def initial_pieces(family_name: str, layouts: list[tuple], row_block_rows: int) -> list[dict[str, list]]:
    """This rank's initial parameters at each of ``layouts`` as ``{global name: [(offsets in the
    global tensor, values)]}``, built with initialisation blocks of ``row_block_rows`` expert rows."""
    return [_initial_pieces(family_name, layout, row_block_rows) for layout in layouts]


def _initial_pieces(family_name: str, layout: tuple, row_block_rows: int) -> dict[str, list]:
    import mega.core.build as build
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.core.parallel.pieces import TensorParallelSplit, tensor_pieces
    from mega.core.parameter_names import canonical_names
    from mega.core.plugins import get_plugins

    family = get_plugins().models.get(family_name)
    config = _tiny_config(family)
    tp, ep, etp, sequence_parallel = layout
    groups = ParallelGroups(ParallelConfig(tp=tp, ep=ep, etp=etp, sequence_parallel=sequence_parallel))
    default_block, build.ROW_BLOCK_ELEMENTS = build.ROW_BLOCK_ELEMENTS, _row_block_elements(config, row_block_rows)
    try:
        model = build.build_stage(family, config, groups=groups, seed=INIT_SEED)
    finally:
        build.ROW_BLOCK_ELEMENTS = default_block
    names = canonical_names(model)
    pieces = {}
    for name, param in model.named_parameters():
        split = TensorParallelSplit.of(param, groups.tp.rank, groups.tp.size)
        pieces[names.get(name, name)] = [(piece.offsets, piece.data.clone())
                                         for piece in tensor_pieces(param.data, split, tuple(param.shape))]
    return pieces


def _row_block_elements(config, rows: int) -> int:
    """Elements of ``rows`` rows of the experts' first projection [experts, 2F, hidden] (smaller
    tensors then have several rows a block, larger ones one)."""
    return rows * 2 * config.moe_ffn_hidden_size * config.hidden_size


def test_expert_layouts_initialise_like_one_process(worlds):
    import mega.core.build as build
    from mega.core.plugins import get_plugins

    families = moe_families()
    assert "mixtral" in families
    for family_name in families:
        family = get_plugins().models.get(family_name)
        config = _tiny_config(family)
        default_block, build.ROW_BLOCK_ELEMENTS = build.ROW_BLOCK_ELEMENTS, _row_block_elements(config, 3)
        try:
            reference = dict(build.build_stage(family, config, seed=INIT_SEED).named_parameters())
        finally:
            build.ROW_BLOCK_ELEMENTS = default_block
        experts = [name for name in reference if ".experts." in name]
        assert experts, f"{family_name}: no expert parameters found"
        ranks = worlds.run(4, initial_pieces, family_name, list(INIT_LAYOUTS.values()), 3)
        for index, layout_name in enumerate(INIT_LAYOUTS):
            what = f"{family_name} at {layout_name}"
            assembled = {name: torch.full_like(value, float("nan")) for name, value in reference.items()}
            for rank_pieces in (layouts[index] for layouts in ranks):
                assert set(rank_pieces) == set(reference), what
                for name, pieces in rank_pieces.items():
                    for offsets, values in pieces:
                        region = assembled[name]
                        for dim, (start, size) in enumerate(zip(offsets, values.shape, strict=True)):
                            region = region.narrow(dim, start, size)
                        region.copy_(values)
            for name, value in reference.items():
                assert torch.equal(assembled[name], value.detach()), f"{what}: {name} differs from one process's"
