"""megatron-core as the reference for the Megatron-LM checkpoint tests: functions that run on the
ranks of a 2-rank gloo world (``mega.testing.DistributedWorld``), build megatron-core's own
``GPTModel`` on the CPU and write, load and describe checkpoints with megatron-core's code.

Test-only shims let its checkpoint writer run without CUDA (reference/megatron-checkpoints.md).
Legacy files are written the way Megatron-LM's ``save_checkpoint`` writes them (a ``torch.save``
per tp/pp rank of ``{args, checkpoint_version, iteration, model, rng_state, ...}``), each stage's
``model`` cut from megatron-core's ``state_dict()``; exported legacy files are checked by loading
them into megatron-core models built for each stage, with strict ``load_state_dict``.
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import torch

VOCAB = 200  # pads to 256 at tp 1 and 2, so megatron-core loads one checkpoint at either
MODELS = {
    "llama": dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                  untie_embeddings_and_output_weights=True),
    # Qwen3's layers: LLaMA's with QK-norm (megatron-core's --qk-layernorm)
    "qwen3": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                  untie_embeddings_and_output_weights=False, qk_layernorm=True),
    "gpt": dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=128,
                swiglu=False, normalization="LayerNorm", position_embedding_type="learned_absolute",
                add_bias_linear=True, untie_embeddings_and_output_weights=False),
    # Megatron-Core's MoE GPTModel, SequentialMLP experts (the local spec without grouped GEMM)
    "mixtral": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                    swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                    untie_embeddings_and_output_weights=True, num_experts=4),
}
SEQ = 32
MOE_ARGS = dict(moe_router_topk=2, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather")


def _shims() -> None:
    import multiprocessing

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    # megatron-core's writer starts a helper process, which Python refuses to daemonic processes
    # such as the test world's ranks (they are ended by the world anyway).
    multiprocessing.current_process()._config["daemon"] = False


def _stop_writer_helper() -> None:
    """End the helper process megatron-core's writer started (it would outlive the rank)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    if queue is not None and getattr(queue, "_manager", None) is not None:
        queue._manager.shutdown()
    filesystem_async._results_queue = None


def leave() -> None:
    """Before the world closes: the rank is daemonic again, so it exits without waiting for children."""
    import multiprocessing

    _stop_writer_helper()
    multiprocessing.current_process()._config["daemon"] = True


def padded_vocab(tp: int) -> int:
    return math.ceil(VOCAB / (128 * tp)) * 128 * tp


def megatron_args(family: str, tp: int, pp: int, iteration: int, ckpt_format: str) -> argparse.Namespace:
    """The args Megatron-LM's pretrain_gpt.py would hold for this model (the ones checkpoints keep)."""
    from megatron.core.enums import ModelType

    m = MODELS[family]
    moe = dict(num_experts=m["num_experts"], moe_ffn_hidden_size=m["ffn_hidden_size"], **MOE_ARGS) \
        if "num_experts" in m else dict(num_experts=None)
    return argparse.Namespace(**moe,
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=m["num_attention_heads"], group_query_attention=m["num_query_groups"] != 4,
        num_query_groups=m["num_query_groups"], kv_channels=m["hidden_size"] // m["num_attention_heads"], seq_length=SEQ, max_position_embeddings=SEQ,
        vocab_size=VOCAB, padded_vocab_size=padded_vocab(tp), make_vocab_size_divisible_by=128,
        swiglu=m["swiglu"], normalization=m["normalization"], position_embedding_type=m["position_embedding_type"],
        add_bias_linear=m["add_bias_linear"], add_qkv_bias=False, norm_epsilon=1e-5, rotary_base=10000,
        rotary_percent=1.0, untie_embeddings_and_output_weights=m["untie_embeddings_and_output_weights"],
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, params_dtype=torch.float32,
        model_type=ModelType.encoder_or_decoder, ckpt_format=ckpt_format, iteration=iteration,
        tokenizer_type="NullTokenizer", transformer_impl="local", qk_layernorm=m.get("qk_layernorm", False),
    )


def _model(family: str, tp: int, layers: int | None = None, pre: bool = True, post: bool = True, seed: int = 0,
           ep: int = 1, pp: int = 1, vpp: int = 1, chunk: int = 0):
    """This rank's part of the model at ``tp`` (and ``pp``: the stage's layers, embeddings, head,
    as megatron-core splits them; ``layers``/``pre``/``post`` build one stage by hand at pp 1).
    An interleaved pipeline (``vpp`` chunks per stage) builds chunk by chunk: the first sets up
    the parallel state, which the others share."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    _shims()
    if chunk == 0:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep,
                                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    vp_stage = chunk if vpp > 1 else None
    if pp > 1:
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        # The tied embedding's copies are made equal by an all-reduce of ``weight.data.cuda()``.
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
    m = MODELS[family]
    experts = m.get("num_experts")
    moe = dict(num_moe_experts=experts, moe_ffn_hidden_size=m["ffn_hidden_size"], moe_aux_loss_coeff=0.0,
               sequence_parallel=tp > 1, **MOE_ARGS) if experts else {}
    config = TransformerConfig(**moe,
        num_layers=layers or m["num_layers"], hidden_size=m["hidden_size"], ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=m["num_attention_heads"], num_query_groups=m["num_query_groups"],
        gated_linear_unit=m["swiglu"], activation_func=F.silu if m["swiglu"] else F.gelu,
        normalization=m["normalization"], add_bias_linear=m["add_bias_linear"], hidden_dropout=0.0,
        qk_layernorm=m.get("qk_layernorm", False),
        attention_dropout=0.0, use_cpu_initialization=True, perform_initialization=True,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, pipeline_dtype=torch.float32 if pp > 1 else None)
    # MoE at tp > 1 requires sequence parallelism, which torch's norms (no TE, no apex) refuse to be
    # built with; it changes no weight or name, only communication: satisfy the check, then build without
    config.sequence_parallel = False
    torch.manual_seed(seed + chunk)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
                         num_experts=experts, moe_grouped_gemm=False, normalization=m["normalization"],
                         qk_layernorm=m.get("qk_layernorm", False)),
                     vocab_size=padded_vocab(tp), max_sequence_length=SEQ, pre_process=pre, post_process=post,
                     position_embedding_type=m["position_embedding_type"],
                     share_embeddings_and_output_weights=not m["untie_embeddings_and_output_weights"], vp_stage=vp_stage)
    return perturbed(model, seed)


def perturbed(model, seed: int):
    """``model`` with its 1-D parameters moved off their starting values (norms start at 1 and
    biases at 0: make every value count), the same on every rank, as norms are replicated."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def made_by_megatron_core(world, root: Path, save, load):
    """(root, truth): the tp 2 checkpoints ``save`` wrote under ``root`` (torch_dist in tp2/, legacy
    in legacy/), and megatron-core's tp 1 view of the model, as ``load`` gives it."""
    world.run(save, str(root / "tp2" / "iter_0000007"), str(root / "legacy"))
    return root, world.run(load, 1, str(root / "tp2" / "iter_0000007"))[0]


def save_torch_dist(family: str, tp: int, directory: str, iteration: int = 7) -> None:
    """What Megatron-LM's save_checkpoint writes with --ckpt-format torch_dist (the model part)."""
    _save_torch_dist(family, tp, directory, iteration)


def _save_torch_dist(family: str, tp: int, directory: str, iteration: int, seed: int = 0, extra=None):
    from megatron.core import dist_checkpointing

    model = _model(family, tp, seed=seed)
    Path(directory).mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    state = {"args": megatron_args(family, tp, 1, iteration, "torch_dist"), "checkpoint_version": 3.0,
             "iteration": iteration, "model": {**model.sharded_state_dict(), **(extra() if extra else {})}}
    dist_checkpointing.save(state, directory)
    _stop_writer_helper()
    if torch.distributed.get_rank() == 0:
        Path(directory).parent.joinpath("latest_checkpointed_iteration.txt").write_text(str(iteration))
    torch.distributed.barrier()
    return model


def save_torch_dist_with_extra_output_layer(family: str, tp: int, directory: str, iteration: int = 7) -> None:
    """A torch_dist checkpoint as megatron-core saves it, plus an output layer (random, split over
    tp as megatron-core splits one) that the model of its args does not have: tied embeddings."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor

    def extra() -> dict:
        rank = parallel_state.get_tensor_model_parallel_rank()
        local = torch.randn(padded_vocab(tp) // tp, MODELS[family]["hidden_size"],
                            generator=torch.Generator().manual_seed(3 + rank))
        replica = parallel_state.get_data_parallel_rank()  # ranks of one tp rank hold copies
        return {"output_layer.weight": ShardedTensor.from_rank_offsets("output_layer.weight", local, (0, rank, tp),
                                                                       replica_id=replica)}

    _save_torch_dist(family, tp, directory, iteration, extra=extra)


def save_both(family: str, torch_dist_dir: str, legacy_dir: str, pp: int = 2, iteration: int = 7) -> None:
    """One tp 2 megatron-core model saved twice: as torch_dist, and as the legacy files of a tp 2 x
    pp ``pp`` run, each stage's state dict cut from the model's (layers renumbered from 0 per
    stage, the tied embedding's copy as the last stage's output_layer.weight)."""
    tp, rank = 2, torch.distributed.get_rank()
    model = _save_torch_dist(family, tp, torch_dist_dir, iteration)
    state = model.state_dict()
    layers = MODELS[family]["num_layers"] // pp
    tied = not MODELS[family]["untie_embeddings_and_output_weights"]
    for stage in range(pp):
        stage_state = stage_state_dict(state, stage, pp, layers, "decoder.layers.", tied)
        path = Path(legacy_dir) / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}_{stage:03d}" / "model_optim_rng.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(_rank_state(megatron_args(family, tp, pp, iteration, "torch"), iteration, stage_state), path)
    if rank == 0:
        (Path(legacy_dir) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    torch.distributed.barrier()


def stage_state_dict(whole: dict, stage: int, pp: int, layers: int, stack: str, tied: bool) -> dict:
    """Pipeline stage ``stage``'s part of a whole model's state dict, as Megatron-LM's stage model
    holds it: its ``layers`` layers of ``stack`` renumbered from 0, the embeddings on the first stage,
    the rest on the last (with the tied embedding's copy as ``output_layer.weight``)."""
    part = {}
    for key, value in whole.items():
        if key.startswith(stack):
            number, rest = key[len(stack):].split(".", 1)
            if int(number) // layers == stage:
                part[f"{stack}{int(number) - stage * layers}.{rest}"] = value
        elif key.startswith("embedding."):
            if stage == 0:
                part[key] = value
        elif stage == pp - 1:
            part[key] = value
    if tied and pp > 1 and stage == pp - 1:
        part["output_layer.weight"] = whole["embedding.word_embeddings.weight"].clone()
    return part


def save_moe(torch_dist_dir: str, legacy_dir: str, iteration: int = 7) -> None:
    """A tp 1 MoE model saved as torch_dist and as legacy files (its state_dict: one tensor per expert)."""
    model = _save_torch_dist("mixtral", 1, torch_dist_dir, iteration)
    if torch.distributed.get_rank() == 0:
        path = Path(legacy_dir) / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"
        path.parent.mkdir(parents=True)
        torch.save(_rank_state(megatron_args("mixtral", 1, 1, iteration, "torch"), iteration, model.state_dict()), path)
        (Path(legacy_dir) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    torch.distributed.barrier()


def save_moe_tp2(torch_dist_dir: str, legacy_dir: str, iteration: int = 7) -> None:
    """A tp 2 MoE model saved as torch_dist and as the legacy files of a tp 2 run: each rank's
    state_dict, every local expert split over the two ranks as a dense MLP is."""
    model = _save_torch_dist("mixtral", 2, torch_dist_dir, iteration)
    rank = torch.distributed.get_rank()
    path = Path(legacy_dir) / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(_rank_state(megatron_args("mixtral", 2, 1, iteration, "torch"), iteration, model.state_dict()), path)
    if rank == 0:
        (Path(legacy_dir) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    torch.distributed.barrier()


def load_torch_dist(family: str, tp: int, directory: str) -> dict[str, torch.Tensor]:
    """megatron-core's dist_checkpointing.load of ``directory`` into a fresh model at ``tp``: the
    model's state dict on rank 0 (tp 1) or this rank's shards."""
    from megatron.core import dist_checkpointing

    model = _model(family, tp, seed=123)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)  # as Megatron-LM does
    model.load_state_dict(loaded["model"], strict=True)
    return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def _rank_state(args, iteration: int, model_state) -> dict:
    """One rank's dict as Megatron-LM's save_checkpoint builds it (generate_state_dict)."""
    import numpy

    rng = {"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}
    return {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": model_state,
            "optimizer": {"optimizer": {"state": {}, "param_groups": [{"lr": 1e-4, "params": [0, 1]}]}},
            "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": iteration * 8}, "rng_state": [rng],
            "num_floating_point_operations_so_far": 0}


def stage_models(family: str, tp: int, pp: int) -> list:
    """This tp rank's megatron-core models of each pipeline stage (built one stage at a time)."""
    layers = MODELS[family]["num_layers"] // pp
    return [_model(family, tp, layers, pre=stage == 0, post=stage == pp - 1, seed=321 + stage)
            for stage in range(pp)]


def load_legacy(family: str, tp: int, pp: int, directory: str, iteration: int | None) -> list[dict]:
    """Each of this tp rank's files loaded into a fresh megatron-core stage model with strict
    load_state_dict (every key present, every shape right); the models' tensors."""
    rank = torch.distributed.get_rank() % tp  # every rank builds (collectively); ranks beyond tp repeat
    loaded = []
    for stage, model in enumerate(stage_models(family, tp, pp)):
        name = f"mp_rank_{rank:02d}" if pp == 1 else f"mp_rank_{rank:02d}_{stage:03d}"
        step = "release" if iteration is None else f"iter_{iteration:07d}"
        state = torch.load(Path(directory) / step / name / "model_optim_rng.pt", weights_only=False)
        model.load_state_dict(state["model"], strict=True)
        loaded.append({k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)})
    return loaded




# -- optimizer state: megatron-core's own optimizer (get_megatron_optimizer), stepped on the CPU ----

def _cpu_tensors_in_optimizer() -> None:
    """megatron-core's optimizer wrappers make a one-element CUDA tensor each (the loss scale): make it here."""
    import megatron.core.optimizer.optimizer as megatron_optimizer

    class _CpuTensors:
        def __getattr__(self, name):
            return getattr(torch, name)

        def tensor(self, *args, device=None, **kwargs):
            return torch.tensor(*args, **kwargs)

    megatron_optimizer.torch = _CpuTensors()


def _optimizer(model):
    """megatron-core's optimizer for ``model`` as Megatron-LM builds it (regular, non-distributed
    Adam; torch's AdamW inside, as megatron-core picks on a machine without TE or apex)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    _cpu_tensors_in_optimizer()
    model.ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=False)
    config = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=0.0,
                             use_distributed_optimizer=False)
    return get_megatron_optimizer(config, [model])


def _with_cuda_type_names(build):
    """``build()`` while CPU tensors give their CUDA type names: megatron-core's bf16 and distributed
    optimizers check each parameter's ``type()`` against the CUDA spellings."""
    plain_type = torch.Tensor.type

    def cuda_type(tensor, *args, **kwargs):
        name = plain_type(tensor, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs else name

    torch.Tensor.type = cuda_type
    try:
        return build()
    finally:
        torch.Tensor.type = plain_type


def _mixed_precision_optimizer(model):
    """megatron-core's bf16 optimizer (Float16OptimizerWithFloat16Params: fp32 main parameters) for
    ``model`` cast to bf16. It asks each parameter for its CUDA type name; CPU tensors answer with
    the CUDA spelling while it is built (a test-only shim, as the others)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    _cpu_tensors_in_optimizer()
    model.to(torch.bfloat16)
    model.ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=False)
    config = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=0.0, bf16=True,
                             use_distributed_optimizer=False)
    return _with_cuda_type_names(lambda: get_megatron_optimizer(config, [model]))


def _inner(optimizer):
    return [chained.optimizer for chained in getattr(optimizer, "chained_optimizers", [optimizer])]


def write_rank_file(directory: str, rank_dir: str, args, iteration: int, model, optimizer) -> None:
    """One rank's ``model_optim_rng.pt`` with ``optimizer.state_dict()``, as Megatron-LM's
    save_checkpoint writes it (and the tracker, on rank 0), then a barrier."""
    state = _rank_state(args, iteration, model.state_dict())
    state["optimizer"] = optimizer.state_dict()
    path = Path(directory) / f"iter_{iteration:07d}" / rank_dir / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    if torch.distributed.get_rank() == 0:
        (Path(directory) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    torch.distributed.barrier()


def step_with_random_gradients(model, optimizer, steps: int, draw_of) -> None:
    """``steps`` steps of ``optimizer`` on gradients drawn at random (its inner optimizers'
    step(), without the CUDA-only grad norm): ``draw_of(name, param)`` names each parameter's draw,
    so parameters that training gives equal gradients (replicas, a tied embedding's copies) draw
    the same."""
    import zlib

    for step in range(steps):
        for name, param in model.named_parameters():
            generator = torch.Generator().manual_seed(zlib.crc32(f"{draw_of(name, param)}/{step}".encode()))
            target = getattr(param, "main_param", param)
            target.grad = torch.randn(target.shape, generator=generator)
        for inner in _inner(optimizer):
            inner.step()


def save_with_optimizer(family: str, tp: int, directory: str, iteration: int = 9, steps: int = 2, ep: int = 1) -> None:
    """A model trained ``steps`` Adam steps by megatron-core's optimizer (gradients drawn at random,
    its step() without the CUDA-only grad norm), saved as Megatron-LM's save_checkpoint does with
    --ckpt-format torch_dist: ``model`` and ``optimizer`` sharded state dicts, args, iteration."""
    args = megatron_args(family, tp, 1, iteration, "torch_dist")
    args.expert_model_parallel_size = ep
    save_trained(_model(family, tp, seed=5, ep=ep), args, directory, iteration, steps,
                 torch.Generator().manual_seed(11 + torch.distributed.get_rank()))


def save_trained(model, args, directory: str, iteration: int, steps: int, generator: torch.Generator) -> None:
    """``model`` after ``steps`` Adam steps of megatron-core's optimizer on gradients drawn from
    ``generator``, saved with the optimizer's state as Megatron-LM's save_checkpoint does with
    --ckpt-format torch_dist (``args``, the iteration, the tracker file)."""
    from megatron.core import dist_checkpointing

    optimizer = _optimizer(model)
    for _ in range(steps):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        for inner in _inner(optimizer):
            inner.step()
    Path(directory).mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    args.consumed_train_samples = iteration * 4
    model_state = model.sharded_state_dict()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": model_state,
             "optimizer": optimizer.sharded_state_dict(model_state)}
    dist_checkpointing.save(state, directory)
    _stop_writer_helper()
    if torch.distributed.get_rank() == 0:
        Path(directory).parent.joinpath("latest_checkpointed_iteration.txt").write_text(str(iteration))
    torch.distributed.barrier()


def load_optimizer(family: str, tp: int, directory: str, ep: int = 1) -> dict:
    """megatron-core's dist_checkpointing.load of the model and optimizer state in ``directory``
    into a fresh model and optimizer at ``tp`` (as Megatron-LM's load_checkpoint does): this rank's
    Adam state by parameter name ({name: {exp_avg, exp_avg_sq, step}})."""
    model = _model(family, tp, seed=77, ep=ep)
    loaded, adam = load_trained(model, directory)
    return adam | {"iteration": loaded.get("iteration")}


def load_trained(model, directory: str) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """Load ``directory``'s model and optimizer state into ``model`` (strict) and a fresh optimizer
    of it, as Megatron-LM's load_checkpoint does: (what dist_checkpointing.load gave, this rank's
    Adam state by parameter name)."""
    from megatron.core import dist_checkpointing

    optimizer = _optimizer(model)
    model_state = model.sharded_state_dict()
    wanted = {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True)}
    loaded = dist_checkpointing.load(wanted, directory)
    model.load_state_dict(loaded["model"], strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    states = {}
    for inner in _inner(optimizer):
        states.update({id(param): state for param, state in inner.state.items()})
    return loaded, {name: {key: value.clone() for key, value in states[id(param)].items()}
                    for name, param in model.named_parameters()}


def save_interleaved(family: str, legacy_dir: str, pp: int = 2, vpp: int = 2, iteration: int = 7) -> None:
    """The tp 2 model of :func:`save_both` (the same seed) as the legacy files of an interleaved
    tp 2 x pp ``pp`` run with ``vpp`` model chunks per stage: each file holds ``model0``,
    ``model1``... (Megatron-LM's save_checkpoint), chunk v of stage p the v * pp + p-th even
    piece of the layers numbered from 0, the embedding in stage 0's first chunk, the final norm,
    output layer (and the tied embedding's copy) in the last stage's last chunk."""
    tp, rank = 2, torch.distributed.get_rank()
    state = _model(family, tp, seed=0).state_dict()
    per_chunk = MODELS[family]["num_layers"] // (pp * vpp)
    tied = not MODELS[family]["untie_embeddings_and_output_weights"]
    args = megatron_args(family, tp, pp, iteration, "torch")
    args.virtual_pipeline_model_parallel_size = vpp
    for stage in range(pp):
        chunks = {}
        for chunk in range(vpp):
            first = (chunk * pp + stage) * per_chunk
            chunk_state = {}
            for key, value in state.items():
                if key.startswith("decoder.layers."):
                    number, rest = key[len("decoder.layers."):].split(".", 1)
                    if first <= int(number) < first + per_chunk:
                        chunk_state[f"decoder.layers.{int(number) - first}.{rest}"] = value
                elif key.startswith("embedding."):
                    if (stage, chunk) == (0, 0):
                        chunk_state[key] = value
                elif (stage, chunk) == (pp - 1, vpp - 1):
                    chunk_state[key] = value
            if tied and (stage, chunk) == (pp - 1, vpp - 1):
                chunk_state["output_layer.weight"] = state["embedding.word_embeddings.weight"].clone()
            chunks[f"model{chunk}"] = chunk_state
        rank_state = _rank_state(args, iteration, None)
        del rank_state["model"]
        path = Path(legacy_dir) / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}_{stage:03d}" / "model_optim_rng.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({**rank_state, **chunks}, path)
    if rank == 0:
        (Path(legacy_dir) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    torch.distributed.barrier()


def _state_by_name(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """The Adam state megatron-core's optimizer holds for each of ``model``'s parameters (and its
    fp32 main parameter, in a bf16 run)."""
    states = {}
    for inner in _inner(optimizer):
        states.update({id(param): state for param, state in inner.state.items()})
    found = {}
    for name, param in model.named_parameters():
        main = getattr(param, "main_param", None)
        state = states[id(main if main is not None else param)]
        found[name] = {key: value.clone() for key, value in state.items()}
        if main is not None:
            found[name]["main_param"] = main.detach().clone()
    return found


def save_legacy_with_optimizer(family: str, directory: str, bf16: bool = False, iteration: int = 9,
                               steps: int = 2) -> list[dict]:
    """The legacy files of a tp 2 x pp 2 run trained ``steps`` Adam steps by megatron-core's regular
    optimizer (one per stage; gradients drawn at random, the same for the tied embedding's two
    copies and for a replicated parameter's tensor-parallel copies, as training makes them), each rank file holding
    ``optimizer.state_dict()`` as Megatron-LM's save_checkpoint stores it: this rank's state by
    parameter name, per stage."""
    tp, pp, rank = 2, 2, torch.distributed.get_rank()
    layers = MODELS[family]["num_layers"] // pp
    tied = not MODELS[family]["untie_embeddings_and_output_weights"]
    truth = []
    for stage in range(pp):
        model = _model(family, tp, layers, pre=stage == 0, post=stage == pp - 1, seed=5 + stage)
        if stage == 0:
            embedding = model.embedding.word_embeddings.weight.detach().clone()
        elif tied and stage == pp - 1:  # Megatron starts the last stage's copy from the embedding
            with torch.no_grad():
                model.output_layer.weight.copy_(embedding)
        optimizer = _mixed_precision_optimizer(model) if bf16 else _optimizer(model)

        def draw_of(name, param, stage=stage):
            shared = "embedding.word_embeddings.weight" if tied and name == "output_layer.weight" else name
            # a parameter whole on every tensor-parallel rank gets the same gradient on each, as it does in training
            split = rank if getattr(param, "tensor_model_parallel", False) else -1
            return f"{split}/{stage * (name == shared)}/{shared}"

        step_with_random_gradients(model, optimizer, steps, draw_of)
        args = megatron_args(family, tp, pp, iteration, "torch")
        args.consumed_train_samples, args.bf16 = iteration * 4, bf16
        state = _rank_state(args, iteration, model.state_dict())
        state["optimizer"] = optimizer.state_dict()
        path = Path(directory) / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}_{stage:03d}" / "model_optim_rng.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        truth.append(_state_by_name(model, optimizer))
    if rank == 0:
        (Path(directory) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    torch.distributed.barrier()
    return truth


def save_legacy_moe_ep2_with_optimizer(directory: str, iteration: int = 9, steps: int = 2) -> dict:
    """The legacy files of an expert-parallel (ep 2, tp 1) MoE run trained ``steps`` Adam steps by
    megatron-core's optimizer, which chains a second optimizer for the experts there: each rank's
    ``optimizer.state_dict()`` is a list (dense, experts) in ``mp_rank_00_00E``. Gradients are the
    same on both ranks for the dense parameters, as training makes them. Returns this rank's state
    by parameter name (its two local experts numbered from 0)."""
    rank = torch.distributed.get_rank()
    model = _model("mixtral", 1, seed=5, ep=2)
    optimizer = _optimizer(model)
    step_with_random_gradients(model, optimizer, steps, lambda name, _: f"{rank if '.experts.' in name else -1}/{name}")
    args = megatron_args("mixtral", 1, 1, iteration, "torch")
    args.consumed_train_samples, args.expert_model_parallel_size = iteration * 4, 2
    write_rank_file(directory, f"mp_rank_00_{rank:03d}", args, iteration, model, optimizer)
    return _state_by_name(model, optimizer)


def load_legacy_optimizer(family: str, directory: str, bf16: bool = False, iteration: int = 9) -> list[dict]:
    """Each of this tp rank's legacy files of a tp 2 x pp 2 run loaded into a fresh megatron-core stage
    model and optimizer (strict load_state_dict, then optimizer.load_state_dict, as Megatron-LM's
    load_checkpoint does): the optimizer's state by parameter name, per stage."""
    tp, pp, rank = 2, 2, torch.distributed.get_rank()
    layers = MODELS[family]["num_layers"] // pp
    loaded = []
    for stage in range(pp):
        model = _model(family, tp, layers, pre=stage == 0, post=stage == pp - 1, seed=77 + stage)
        optimizer = _mixed_precision_optimizer(model) if bf16 else _optimizer(model)
        state = torch.load(Path(directory) / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}_{stage:03d}" /
                           "model_optim_rng.pt", weights_only=False)
        model.load_state_dict(state["model"], strict=True)
        optimizer.load_state_dict(state["optimizer"])
        loaded.append(_state_by_name(model, optimizer))
    return loaded


# -- the distributed optimizer: megatron-core's DDP buffers and DistributedOptimizer, on the CPU ----

def save_with_distributed_optimizer(family: str, directory: str, bucket_size: int | None, iteration: int = 9,
                                    steps: int = 2, legacy_dir: str | None = None, tp: int = 1,
                                    pp: int = 1, ep: int = 1, vpp: int = 1) -> dict[str, list]:
    """A model at ``tp`` x ``pp`` (``vpp`` chunks per stage), data-parallel over the world's other ranks, trained ``steps`` Adam steps by megatron-core's
    DistributedOptimizer (each rank stepping its shard of the grad buffers; gradients drawn at random),
    saved as Megatron-LM's save_checkpoint does with --ckpt-format torch_dist and its default
    ``dp_reshardable`` sharding. ``bucket_size``: DDP's (with --overlap-grad-reduce), or None for
    one bucket. With ``legacy_dir``, also the legacy files of the run (--ckpt-format torch): the
    model and ``optimizer.state_dict()`` in ``model_optim_rng.pt``, the buffers gathered by
    ``save_parameter_state`` into ``distrib_optim.pt``. Returns what this rank's optimizer holds:
    parameter name -> [(start, end, {param, exp_avg, exp_avg_sq})], each piece a flat range of the
    parameter (an interleaved pipeline's named ``model<chunk>.<name in the chunk>``)."""
    from megatron.core import dist_checkpointing

    ddps, optimizer = _distributed_optimizer(family, bucket_size, seed=5, tp=tp, pp=pp, ep=ep, vpp=vpp)
    distributed = getattr(optimizer, "chained_optimizers", [optimizer])
    generator = torch.Generator().manual_seed(11)  # the same on every rank: gradients already reduced
    for _ in range(steps):
        for param in (param for ddp in ddps for param in ddp.module.parameters()):
            param.main_grad.copy_(torch.randn(param.shape, generator=generator))
        for shard in distributed:
            shard._copy_model_grads_to_main_grads()
            shard.optimizer.step()
            shard._copy_main_params_to_model_params()
    args = _family_args(family, tp, pp, iteration, "torch_dist")
    args.consumed_train_samples, args.use_distributed_optimizer = iteration * 4, True
    args.data_parallel_size, args.expert_model_parallel_size = torch.distributed.get_world_size() // (tp * pp), ep
    args.overlap_grad_reduce = bucket_size is not None
    args.ddp_bucket_size, args.virtual_pipeline_model_parallel_size = bucket_size, vpp if vpp > 1 else None
    Path(directory).mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    model_state = {"model": ddps[0].module.sharded_state_dict()} if vpp == 1 else \
        {f"model{chunk}": ddp.module.sharded_state_dict() for chunk, ddp in enumerate(ddps)}
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, **model_state,
             "optimizer": optimizer.sharded_state_dict(model_state,
                                                       metadata={"distrib_optim_sharding_type": "dp_reshardable"})}
    dist_checkpointing.save(state, directory)
    _stop_writer_helper()
    if torch.distributed.get_rank() == 0:
        Path(directory).parent.joinpath("latest_checkpointed_iteration.txt").write_text(str(iteration))
    torch.distributed.barrier()
    if legacy_dir is not None:
        _save_distributed_legacy(legacy_dir, args, iteration, ddps, optimizer, pp, ep, vpp)
    return _held_by_name(ddps, optimizer)


def _save_distributed_legacy(legacy_dir: str, args, iteration: int, ddps, optimizer, pp: int, ep: int,
                             vpp: int) -> None:
    """The legacy files (--ckpt-format torch) of a distributed-optimizer run: the model and
    ``optimizer.state_dict()`` in ``model_optim_rng.pt``, the buffers gathered by
    ``save_parameter_state`` into ``distrib_optim.pt``."""
    from megatron.core import parallel_state

    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    rank_dir = Path(legacy_dir) / f"iter_{iteration:07d}" / (
        f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else ""))
    rank_dir.mkdir(parents=True, exist_ok=True)
    args.ckpt_format = "torch"
    optimizer.save_parameter_state(str(rank_dir / "distrib_optim.pt"))  # gathers over data-parallel ranks
    writer = parallel_state.get_expert_data_parallel_rank() if ep > 1 else parallel_state.get_data_parallel_rank()
    if writer == 0:
        rank_state = _rank_state(args, iteration, None)
        del rank_state["model"]  # an interleaved pipeline's file holds model0, model1...
        rank_state.update({"model": ddps[0].module.state_dict()} if vpp == 1 else
                          {f"model{chunk}": ddp.module.state_dict() for chunk, ddp in enumerate(ddps)})
        rank_state["optimizer"] = optimizer.state_dict()
        torch.save(rank_state, rank_dir / "model_optim_rng.pt")
        (Path(legacy_dir) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    torch.distributed.barrier()


def _distributed_optimizer(family: str, bucket_size: int | None, seed: int, tp: int = 1, pp: int = 1, ep: int = 1,
                           vpp: int = 1):
    """This rank's part of a ``tp`` x ``pp`` model, a DDP (gradient buffers, the world's other ranks
    data-parallel) per model chunk (the later ones unbucketed, as Megatron-LM builds them), and
    their DistributedOptimizer, built on the CPU."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    chunks = [_family_model(family, tp, seed, pp, ep, vpp, chunk) for chunk in range(vpp)]
    _cpu_tensors_in_optimizer()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                               overlap_grad_reduce=bucket_size is not None, bucket_size=bucket_size)
    ddps = [DistributedDataParallel(model.config, ddp_config, model, disable_bucketing=chunk > 0)
            for chunk, model in enumerate(chunks)]
    config = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=0.0, use_distributed_optimizer=True)
    return ddps, _with_cuda_type_names(lambda: get_megatron_optimizer(config, ddps))


def _family_model(family: str, tp: int, seed: int, pp: int = 1, ep: int = 1, vpp: int = 1, chunk: int = 0):
    """This rank's part of ``family``'s reference model: GPT, LLaMA and Mixtral (any pp) here, BERT
    and Megatron-LM's default T5 (pp 1) from their modules."""
    if family == "bert":
        from megatron_bert_reference import bert_model

        return bert_model(tp, seed=seed)
    if family == "t5":
        from megatron_t5_reference import t5_model

        return t5_model(tp, seed=seed, architecture="megatron")
    return _model(family, tp, seed=seed, pp=pp, ep=ep, vpp=vpp, chunk=chunk)


def _family_args(family: str, tp: int, pp: int, iteration: int, ckpt_format: str):
    if family == "bert":
        from megatron_bert_reference import bert_megatron_args

        return bert_megatron_args(tp, pp, iteration, ckpt_format)
    if family == "t5":
        from megatron_t5_reference import t5_megatron_args

        return t5_megatron_args(tp, iteration, ckpt_format, "megatron")
    return megatron_args(family, tp, pp, iteration, ckpt_format)


def _held_by_name(ddps, optimizer) -> dict[str, list]:
    """What this rank's distributed optimizer holds: parameter name -> [(start, end, {param,
    exp_avg, exp_avg_sq})], each piece a flat range of the parameter (``model<chunk>.`` in front
    with several model chunks)."""
    names = {id(param): name if len(ddps) == 1 else f"model{chunk}.{name}"
             for chunk, ddp in enumerate(ddps) for name, param in ddp.module.named_parameters()}
    held: dict[str, list] = {}
    for shard in getattr(optimizer, "chained_optimizers", [optimizer]):
        for buffer_ranges in shard.gbuf_ranges:
            for bucket_ranges in buffer_ranges.values():
                for bucket in bucket_ranges:
                    for param, ranges in bucket["param_map"].items():
                        tensors = shard._get_main_param_and_optimizer_states(param)
                        held.setdefault(names[id(param)], []).append(
                            (ranges["param"].start, ranges["param"].end,
                             {key: value.detach().clone() for key, value in tensors.items()}))
    return held


def load_with_distributed_optimizer(family: str, directory: str, tp: int = 1) -> tuple[int, dict[str, list]]:
    """What Megatron-LM's load_checkpoint does for a --use-distributed-optimizer run at ``tp`` (the
    world's other ranks data-parallel): the sharding kind from the checkpoint's content metadata,
    dist_checkpointing.load of the model and optimizer, the optimizer's load_state_dict. Returns
    the step and what this rank's optimizer then holds (see :func:`_held_by_name`).

    Two more shims, both for torch's AdamW (megatron-core's choice without TE or apex), which keeps
    a ``step`` per parameter where TE's and apex's Adam keep it in the param groups: the fresh
    optimizer's state is made as AdamW makes it (megatron-core's state_dict reads the step there),
    and the loaded state, which leaves the step out (it comes from the param groups), is copied
    into every key of the inner state but ``step``."""
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def keeping_step(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        return set_states(self, model_param, {**tensors, **({"step": state["step"]} if "step" in state else {})})

    DistributedOptimizer._set_main_param_and_optimizer_states = keeping_step
    (ddp,), optimizer = _distributed_optimizer(family, None, seed=77, tp=tp)
    for inner in _inner(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                      "exp_avg_sq": torch.zeros_like(param)}
    metadata = dist_checkpointing.load_content_metadata(directory)
    model_state = ddp.module.sharded_state_dict()
    wanted = {"model": model_state,
              "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True, metadata=metadata)}
    loaded = dist_checkpointing.load(wanted, directory)
    ddp.module.load_state_dict(loaded["model"], strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    steps = {int(state["step"]) for inner in _inner(optimizer) for state in inner.state.values()}
    (step,) = steps
    return step, _held_by_name([ddp], optimizer)
