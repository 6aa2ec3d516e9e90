"""`mega train` of the qwen3, qwen3-moe and deepseek-v3 families at parallel layouts computes what
one process computes: 2 steps of tiny models (2 layers, hidden 32 or 64) on Megatron's mock data in fp32,
every loss within 1e-5 (relative) of the one-process run's. Each layout is one call on one world
of 2 gloo ranks.

qwen3: tp2 (QK-norm weights see only a rank's own heads: their gradients are summed over the tensor
group; SGD and a large initialisation so that a missing sum shows). qwen3-moe: tp2 x etp1 x ep2 with
sequence parallelism (whole experts spread over the tensor ranks; the 2 ranks' tp2 x ep2), the
load-balancing loss on.
deepseek-v3 (MLA, a dense then a MoE layer with shared experts, sigmoid group routing, the expert
bias moved after every step, one MTP module): tp2 + sequence parallelism, ep2 with the distributed
optimizer, pp2 (MTP on the last stage, which holds a tied copy of the word embedding) and, without
MTP, cp2 (ring attention: values padded to the query/key head size)."""

from __future__ import annotations

from mega.train.testing.training_runs import assert_losses_close, train_losses

STEPS = ["--mock-data", "--num-layers", "2", "--seq-length", "16", "--vocab-size", "90",
         "--make-vocab-size-divisible-by", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "2", "--optimizer", "sgd", "--lr", "0.5", "--lr-decay-style", "constant", "--eval-iters", "0",
         "--log-interval", "100", "--seed", "7", "--init-method-std", "0.2"]
QWEN3 = ["--model-family", "qwen3", "--model-preset", "tiny", "--hidden-size", "32", "--ffn-hidden-size", "64",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16", *STEPS]
QWEN3_MOE = ["--model-family", "qwen3-moe", "--model-preset", "tiny", "--hidden-size", "32",
             "--moe-ffn-hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
             "--kv-channels", "16", "--moe-aux-loss-coeff", "0.01", *STEPS]
DEEPSEEK = ["--model-family", "deepseek-v3", "--model-preset", "tiny", "--moe-token-dispatcher-type", "alltoall",
            "--moe-router-bias-update-rate", "0.01", *STEPS]
NO_MTP = ["--mtp-num-layers", "0"]
TP2 = ["--tensor-model-parallel-size", "2"]
SP = ["--sequence-parallel"]

# name -> (one-process flags, flags of the layout)
RUNS = {
    "qwen3 tp2": (QWEN3, TP2),
    "qwen3-moe tp2 x etp1 x ep2 sp": (QWEN3_MOE, TP2 + SP + ["--expert-tensor-parallel-size", "1",
                                                             "--expert-model-parallel-size", "2"]),
    "deepseek-v3 tp2 sp": (DEEPSEEK, TP2 + SP),
    "deepseek-v3 ep2 distributed optimizer": (DEEPSEEK, ["--expert-model-parallel-size", "2",
                                                         "--use-distributed-optimizer"]),
    "deepseek-v3 pp2 (MTP on the last stage)": (DEEPSEEK, ["--pipeline-model-parallel-size", "2"]),
    "deepseek-v3 cp2 without MTP": (DEEPSEEK + NO_MTP, ["--context-parallel-size", "2"]),
}


def test_layouts_train_like_one_process(worlds):
    references = {}
    for name, (common, layout) in RUNS.items():
        key = tuple(common)
        if key not in references:
            references[key] = train_losses(common)
            assert references[key][-1] < references[key][0], f"{name}: the tiny model should learn"
        ranks = worlds.run(2, train_losses, common + layout)
        assert all(losses == ranks[0] for losses in ranks), name
        assert_losses_close(ranks[0], references[key], name)
