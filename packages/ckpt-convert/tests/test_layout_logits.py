"""Hugging Face models converted to mega at tp1/pp1, tp2, pp2 and tp2 x pp2, loaded into stages
built at that layout, give the logits and the loss transformers gives (fp32, 1e-5 relative); the
300-token vocabulary pads to 384 rows at tp1 and 512 at tp2, and the padding takes no part. One world of 4
gloo ranks runs every multi-rank layout (dp takes the ranks tp and pp leave)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import VARIANTS, hf_logits, input_ids  # noqa: E402

pytest.importorskip("transformers")

from mega.ckpt_convert import WriteOptions, convert  # noqa: E402

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}  # name -> (tp, pp), on 4 ranks


def stage_logits(source, ids: torch.Tensor, groups) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Logits ``[b, s, vocab]`` and next-token loss (the mean over ``ids``' positions but the
    last) of the model in ``source`` (a mega checkpoint path or a model source) built as this
    rank's stage of ``groups``' layout; None on ranks not last in the pipeline."""
    import torch.distributed as dist

    from mega.ckpt_convert import open_checkpoint
    from mega.core.build import build_stage
    from mega.core.checkpoint import load_model_weights
    from mega.core.parallel.collectives import gather_along
    from mega.core.plugins import get_plugins

    opened = open_checkpoint(source) if isinstance(source, str) else source
    family, config = get_plugins().models.get(opened.family), opened.config
    pp_rank, pp_size = groups.pp.rank, groups.pp.size
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    stage = build_stage(family, config, family.pipeline_stages(config, pp_size)[pp_rank], groups=groups, init=False)
    load_model_weights(source, [stage.eval()], groups)
    if not first:  # hidden states [s, b, h] from the previous stage
        inputs = torch.empty(ids.shape[1], ids.shape[0], config.hidden_size)
        dist.recv(inputs, src=groups.pp.ranks[pp_rank - 1])
    with torch.no_grad():
        outputs = stage(ids if first else inputs)
    if not last:
        dist.send(outputs, dst=groups.pp.ranks[pp_rank + 1])
        return None
    next_ids = torch.roll(ids, -1, dims=1)  # the last position's label is never used
    loss = stage.loss(outputs, next_ids, groups.tp)[:, :-1].mean()
    return gather_along(outputs, groups.tp, dim=-1).transpose(0, 1)[..., : config.vocab_size], loss


def every_layout(checkpoints: dict, hf_dirs: dict, ids: torch.Tensor) -> dict:
    from mega.ckpt_convert import open_checkpoint
    from mega.core.parallel import ParallelConfig, ParallelGroups

    results = {}
    for layout, (tp, pp) in LAYOUTS.items():
        groups = ParallelGroups(ParallelConfig(tp=tp, pp=pp))
        for variant in VARIANTS:
            results[variant, layout] = stage_logits(checkpoints[variant, layout], ids, groups)
            if layout == "tp2":  # a Hugging Face directory straight into a layout, as serving does
                with open_checkpoint(hf_dirs[variant]) as source:
                    results[variant, "tp2 from hf"] = stage_logits(source, ids, groups)
    return results


@pytest.fixture(scope="module")
def checkpoints(hf_dirs, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("layouts")
    paths = {}
    for variant in VARIANTS:
        for layout, (tp, pp) in {"tp1pp1": (1, 1), **LAYOUTS}.items():
            paths[variant, layout] = str(root / f"{variant}-{layout}")
            convert(hf_dirs[variant], paths[variant, layout], to_format="mega",
                    options=WriteOptions(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    return paths


def test_one_process_logits_equal_transformers(checkpoints, hf_dirs, assert_close):
    from mega.core.parallel import ParallelConfig, ParallelGroups

    ids = input_ids()
    for variant in VARIANTS:
        logits, loss = stage_logits(checkpoints[variant, "tp1pp1"], ids, ParallelGroups(ParallelConfig()))
        expected_logits, expected_loss = hf_logits(hf_dirs[variant], ids, with_loss=True)
        assert_close(logits, expected_logits, what=variant)
        assert_close(loss, expected_loss, what=f"{variant} loss")


def test_every_layout_logits_equal_transformers(worlds, checkpoints, hf_dirs, assert_close):
    ids = input_ids(seed=1)
    ranks = worlds.run(4, every_layout, checkpoints, {k: str(v) for k, v in hf_dirs.items()}, ids)
    for variant in VARIANTS:
        expected, expected_loss = hf_logits(hf_dirs[variant], ids, with_loss=True)
        for layout, (_, pp) in LAYOUTS.items():
            for what in (layout, "tp2 from hf") if layout == "tp2" else (layout,):
                last_stage_ranks = [r for r, results in enumerate(ranks) if results[variant, what] is not None]
                assert len(last_stage_ranks) == 4 // pp
                for rank in last_stage_ranks:
                    logits, loss = ranks[rank][variant, what]
                    assert_close(logits, expected, what=f"{variant} {what} rank {rank}")
                    assert_close(loss, expected_loss, what=f"{variant} {what} rank {rank} loss")
