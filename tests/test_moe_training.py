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
"""

from __future__ import annotations

from mega.core.testing.training_runs import assert_losses_close, train_losses

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
