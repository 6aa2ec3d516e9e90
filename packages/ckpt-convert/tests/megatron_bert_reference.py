"""megatron-core's ``BertModel`` as the reference for Megatron-LM BERT checkpoints: functions that run
on the ranks of a 2-rank gloo world, build the model on the CPU (local layer spec, binary head, tied
output layer as ``pretrain_bert.py`` builds it), write and load its checkpoints with megatron-core's
own code, and run its forward (on the CPU with one more shim: the model-parallel RNG tracker's fork
is a no-op, as nothing is random without dropout). The CPU shims and the legacy rank dict are
:mod:`megatron_reference`'s.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
from megatron_reference import (
    _rank_state,
    _shims,
    _stop_writer_helper,
    padded_vocab,
    perturbed,
    stage_state_dict,
)

VOCAB, LAYERS, SEQ = 200, 4, 32
SHAPE = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128)


def bert_megatron_args(tp: int, pp: int, iteration: int, ckpt_format: str) -> argparse.Namespace:
    """The args Megatron-LM's pretrain_bert.py holds for this model (the ones checkpoints keep)."""
    return argparse.Namespace(
        **SHAPE, num_layers=LAYERS, num_query_groups=4, group_query_attention=False, kv_channels=16,
        seq_length=SEQ, max_position_embeddings=SEQ, vocab_size=VOCAB, padded_vocab_size=padded_vocab(tp),
        make_vocab_size_divisible_by=128, swiglu=False, normalization="LayerNorm", norm_epsilon=1e-5,
        position_embedding_type="learned_absolute", add_bias_linear=True, add_qkv_bias=False,
        untie_embeddings_and_output_weights=False, bert_binary_head=True, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None, params_dtype=torch.float32, ckpt_format=ckpt_format,
        iteration=iteration, tokenizer_type="NullTokenizer", transformer_impl="local")


def bert_model(tp: int, layers: int = LAYERS, pre: bool = True, post: bool = True, seed: int = 0):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    _shims()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    config = TransformerConfig(**SHAPE, num_layers=layers, hidden_dropout=0.0, attention_dropout=0.0,
                               use_cpu_initialization=True, perform_initialization=True,
                               tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    model = BertModel(config=config, num_tokentypes=2, transformer_layer_spec=bert_layer_local_spec,
                      vocab_size=padded_vocab(tp), max_sequence_length=SEQ, add_binary_head=True,
                      share_embeddings_and_output_weights=True, pre_process=pre, post_process=post)
    return perturbed(model, seed)


def save_bert(torch_dist_dir: str, legacy_dir: str, pp: int = 2, iteration: int = 7) -> None:
    """One tp 2 BERT saved as torch_dist and as the legacy files of a tp 2 x pp ``pp`` run, each
    stage's state dict cut from the model's (layers renumbered from 0 per stage, the tied
    embedding's copy as the last stage's output_layer.weight)."""
    from megatron.core import dist_checkpointing

    tp, rank = 2, torch.distributed.get_rank()
    model = bert_model(tp)
    Path(torch_dist_dir).mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    state = {"args": bert_megatron_args(tp, 1, iteration, "torch_dist"), "checkpoint_version": 3.0,
             "iteration": iteration, "model": model.sharded_state_dict()}
    dist_checkpointing.save(state, torch_dist_dir)
    _stop_writer_helper()
    whole, per_stage = model.state_dict(), LAYERS // pp
    for stage in range(pp):
        stage_state = stage_state_dict(whole, stage, pp, per_stage, "encoder.layers.", tied=True)
        path = Path(legacy_dir) / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}_{stage:03d}" / "model_optim_rng.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(_rank_state(bert_megatron_args(tp, pp, iteration, "torch"), iteration, stage_state), path)
    if rank == 0:
        for directory in (Path(torch_dist_dir).parent, Path(legacy_dir)):
            (directory / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    torch.distributed.barrier()


def load_bert_torch_dist(tp: int, directory: str) -> dict[str, torch.Tensor]:
    """dist_checkpointing.load of ``directory`` into a fresh model at ``tp``: this rank's tensors."""
    from megatron.core import dist_checkpointing

    model = bert_model(tp, seed=123)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(loaded["model"], strict=True)
    return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def load_bert_legacy(tp: int, pp: int, directory: str, iteration: int) -> list[dict[str, torch.Tensor]]:
    """Each of this tp rank's files loaded into a fresh stage model with strict load_state_dict."""
    rank, per_stage, loaded = torch.distributed.get_rank() % tp, LAYERS // pp, []
    for stage in range(pp):
        model = bert_model(tp, per_stage, pre=stage == 0, post=stage == pp - 1, seed=321 + stage)
        name = f"mp_rank_{rank:02d}" if pp == 1 else f"mp_rank_{rank:02d}_{stage:03d}"
        state = torch.load(Path(directory) / f"iter_{iteration:07d}" / name / "model_optim_rng.pt", weights_only=False)
        model.load_state_dict(state["model"], strict=True)
        loaded.append({k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)})
    return loaded


def bert_logits(directory: str, ids: torch.Tensor, types: torch.Tensor, padding: torch.Tensor):
    """megatron-core's own forward of the tp 1 model loaded from the torch_dist ``directory``:
    (masked-LM logits [b, s, vocab], binary logits [b, 2])."""
    from megatron.core import dist_checkpointing

    model = bert_model(1, seed=5)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(loaded["model"], strict=True)
    with torch.no_grad():
        return model.eval()(ids, padding, tokentype_ids=types)
