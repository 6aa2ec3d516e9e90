"""The setup runner (mega.core.setup_passes): phase order whatever the order given, name order
within a phase, the meta device before MATERIALIZE, chunks a pass replaces, and two passes of one
name refused. CPU only (pinned: nothing leaves the CPU), the same on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mega.core.setup_passes import ModelSetup, Phase, SetupError, SetupPass, per_chunk, run_setup


def recorder(log: list, name: str, phase: Phase) -> SetupPass:
    def apply(setup: ModelSetup) -> None:
        log.append((name, torch.empty(1).device.type))  # where a module made now would live

    return SetupPass(name, phase, apply)


def setup_of(*chunks: nn.Module) -> ModelSetup:
    return ModelSetup(list(chunks), family=None, config=None, groups=None, parallel=None)


def test_passes_run_by_phase_then_name_whatever_the_order_given():
    # The materialising passes run where modules are made: the CPU here, a GPU machine too. A
    # device context, not set_default_device: a default left set is a torch-function mode under
    # which dynamo breaks later tests' graphs (Tensor.unflatten's super() call).
    with torch.device("cpu"):
        orders = []
        for reverse in (False, True):
            log: list = []
            passes = [recorder(log, "wrap", Phase.DATA_PARALLEL), recorder(log, "b-fp8", Phase.PRECISION),
                      recorder(log, "a-fp8", Phase.PRECISION), recorder(log, "plan", Phase.TENSOR_PARALLEL),
                      recorder(log, "store", Phase.MATERIALIZE), recorder(log, "experts", Phase.EXPERT_PARALLEL)]
            run_setup(setup_of(), reversed(passes) if reverse else passes)
            orders.append(log)
    assert orders[0] == orders[1] == [("experts", "meta"), ("plan", "meta"), ("store", "cpu"), ("a-fp8", "cpu"),
                                      ("b-fp8", "cpu"), ("wrap", "cpu")]


def test_a_chunk_pass_may_replace_the_chunk_and_names_are_unique():
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    wrap = per_chunk("wrap", Phase.DATA_PARALLEL, lambda chunk, setup: nn.Sequential(chunk))
    keep = per_chunk("keep", Phase.COMPILE, lambda chunk, setup: None)
    chunks = run_setup(setup_of(first, second), [wrap, keep])
    assert [type(chunk) for chunk in chunks] == [nn.Sequential, nn.Sequential]
    assert chunks[0][0] is first and chunks[1][0] is second
    with pytest.raises(SetupError, match="setup pass 'wrap' given twice"):
        run_setup(setup_of(first), [wrap, keep, wrap])
