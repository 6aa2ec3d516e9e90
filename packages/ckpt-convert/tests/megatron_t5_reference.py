"""megatron-core's ``T5Model`` as the reference for Megatron-LM T5 checkpoints: functions that run on
the ranks of a 2-rank gloo world, build the model on the CPU (local layer specs, torch norms for the
stacks' final norms), and write and load its checkpoints with megatron-core's own code. The CPU
shims and the legacy rank dict are :mod:`megatron_reference`'s.

Two architectures, both with exact GELU and a tied output layer (with megatron-core's output
bias): ``relative`` (relative positions, RMSNorm, no biases: Google's T5 layout) and ``megatron``
(Megatron-LM's default T5: learned absolute positions, LayerNorm, biases everywhere). On the CPU
megatron-core's forward of the second runs with one more shim: the model-parallel RNG tracker's
fork, which wants CUDA, does nothing (dropout is 0). (The first's relative-position bias needs
Transformer Engine's attention.)
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
from megatron_reference import _rank_state, _shims, _stop_writer_helper, padded_vocab, perturbed

VOCAB = 200
SHAPE = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, kv_channels=16)
ENCODER_LAYERS, DECODER_LAYERS = 3, 2
ENCODER_SEQ, DECODER_SEQ = 32, 16
ARCHITECTURES = {  # Megatron-LM arguments of each
    "relative": dict(position_embedding_type="relative", normalization="RMSNorm", add_bias_linear=False),
    "megatron": dict(position_embedding_type="learned_absolute", normalization="LayerNorm", add_bias_linear=True),
}


def t5_megatron_args(tp: int, iteration: int, ckpt_format: str, architecture: str = "relative") -> argparse.Namespace:
    """The args Megatron-LM's pretrain_t5.py holds for this model (the ones checkpoints keep)."""
    return argparse.Namespace(**ARCHITECTURES[architecture],
        **SHAPE, num_layers=ENCODER_LAYERS, encoder_num_layers=ENCODER_LAYERS, decoder_num_layers=DECODER_LAYERS,
        seq_length=ENCODER_SEQ, encoder_seq_length=ENCODER_SEQ, decoder_seq_length=DECODER_SEQ,
        max_position_embeddings=ENCODER_SEQ, vocab_size=VOCAB, padded_vocab_size=padded_vocab(tp),
        make_vocab_size_divisible_by=128, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, norm_epsilon=1e-6, add_qkv_bias=False, swiglu=False, openai_gelu=False, squared_relu=False, group_query_attention=False,
        num_query_groups=1, untie_embeddings_and_output_weights=False, init_method_std=0.02, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, params_dtype=torch.float32, ckpt_format=ckpt_format,
        iteration=iteration, tokenizer_type="NullTokenizer", transformer_impl="local")


def t5_model(tp: int, seed: int = 0, architecture: str = "relative"):
    import torch.nn.functional as F
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.T5.t5_model import T5Model
    from megatron.core.models.T5.t5_spec import decoder_model_with_local_spec, encoder_model_with_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    _shims()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    chosen = ARCHITECTURES[architecture]

    def config(layers: int) -> TransformerConfig:
        return TransformerConfig(**SHAPE, num_layers=layers, normalization=chosen["normalization"],
                                 layernorm_epsilon=1e-6, add_bias_linear=chosen["add_bias_linear"],
                                 gated_linear_unit=False, activation_func=F.gelu,
                                 hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                                 perform_initialization=True, tensor_model_parallel_size=tp)

    # The T5 block specs name Transformer Engine's norm for the stacks' final norms: torch's here.
    encoder = TransformerBlockSubmodules([encoder_model_with_local_spec()] * ENCODER_LAYERS, layer_norm=WrappedTorchNorm)
    decoder = TransformerBlockSubmodules([decoder_model_with_local_spec()] * DECODER_LAYERS, layer_norm=WrappedTorchNorm)
    torch.manual_seed(seed)
    model = T5Model(config=config(DECODER_LAYERS), encoder_config=config(ENCODER_LAYERS),
                    transformer_encoder_layer_spec=encoder, transformer_decoder_layer_spec=decoder,
                    vocab_size=padded_vocab(tp), max_sequence_length=ENCODER_SEQ,
                    position_embedding_type=chosen["position_embedding_type"],
                    share_embeddings_and_output_weights=True)
    return perturbed(model, seed)


def save_t5(torch_dist_dir: str, legacy_dir: str, iteration: int = 7, architecture: str = "relative") -> None:
    """One tp 2 T5 saved as Megatron-LM saves it: torch_dist (dist_checkpointing.save) and the
    legacy files of a tp 2 run (each rank's state_dict)."""
    from megatron.core import dist_checkpointing

    tp, rank = 2, torch.distributed.get_rank()
    model = t5_model(tp, architecture=architecture)
    Path(torch_dist_dir).mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    state = {"args": t5_megatron_args(tp, iteration, "torch_dist", architecture), "checkpoint_version": 3.0,
             "iteration": iteration, "model": model.sharded_state_dict()}
    dist_checkpointing.save(state, torch_dist_dir)
    _stop_writer_helper()
    path = Path(legacy_dir) / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(_rank_state(t5_megatron_args(tp, iteration, "torch", architecture), iteration, model.state_dict()),
               path)
    if rank == 0:
        for directory in (Path(torch_dist_dir).parent, Path(legacy_dir)):
            (directory / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    torch.distributed.barrier()


def _loaded_t5(tp: int, directory: str, architecture: str):
    """A fresh model at ``tp`` that dist_checkpointing.load filled from ``directory``."""
    from megatron.core import dist_checkpointing

    model = t5_model(tp, seed=123, architecture=architecture)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(loaded["model"], strict=True)
    return model


def load_t5_torch_dist(tp: int, directory: str, architecture: str = "relative") -> dict[str, torch.Tensor]:
    """dist_checkpointing.load of ``directory`` into a fresh model at ``tp``: this rank's tensors."""
    model = _loaded_t5(tp, directory, architecture)
    return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def t5_logits(directory: str, architecture: str, ids: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
    """megatron-core's own forward of the tp 1 model loaded from the torch_dist ``directory``:
    logits ``[b, decoder seq, padded vocab]`` (no padding; the decoder causal)."""
    model = _loaded_t5(1, directory, architecture)
    batch, enc, dec = ids.shape[0], ids.shape[1], decoder_ids.shape[1]
    masked = torch.ones(dec, dec, dtype=torch.bool).triu(1)  # True: hidden
    with torch.no_grad():
        return model.eval()(ids, decoder_ids, torch.zeros(batch, 1, enc, enc, dtype=torch.bool),
                            masked[None, None].expand(batch, 1, dec, dec), torch.zeros(batch, 1, dec, enc, dtype=torch.bool))


def load_t5_legacy(tp: int, directory: str, iteration: int, architecture: str = "relative") -> dict[str, torch.Tensor]:
    """This tp rank's legacy file loaded into a fresh model with strict load_state_dict."""
    model = t5_model(tp, seed=321, architecture=architecture)
    rank = torch.distributed.get_rank() % tp
    state = torch.load(Path(directory) / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt",
                       weights_only=False)
    model.load_state_dict(state["model"], strict=True)
    return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def relative_bias(bidirectional: bool, query: int, key: int) -> torch.Tensor:
    """megatron-core's RelativePositionEmbedding with known weights: [1, heads, query, key]."""
    from megatron.core.models.common.embeddings.relative_pos_embedding import RelativePositionEmbedding

    embedding = RelativePositionEmbedding(bidirectional=bidirectional, init_method=torch.nn.init.zeros_,
                                          num_attention_heads=4, relative_attention_num_buckets=32,
                                          relative_attention_max_distance=128)
    with torch.no_grad():
        embedding.relative_attention_bias.weight.copy_(torch.arange(32 * 4, dtype=torch.float32).view(32, 4))
        return embedding(query, key)
