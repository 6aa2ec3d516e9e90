"""Where each global tensor sits in a Megatron-LM layout: its tensor-parallel split, its pipeline
stage (and model chunk) and the layer number it has there; the helpers every reader and writer
shares (an expert's split, the vocabulary rows a layout pads to).

The splits are the model family's own tensor-parallel plan (``tensor_parallel_plan``: column-,
row-wise, vocabulary), which follows Megatron's: QKV split along dim 0 into whole query groups (the global tensor interleaves per
group, so contiguous slices are whole groups), SwiGLU's fc1 split as gate and up halves each
(rank r holds ``[gate_r; up_r]``), the vocabulary split in rows after padding to
``make_vocab_size_divisible_by * tp``, row-parallel layers split along dim 1, norms and the
row-parallel biases whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.megatron.names import LAYER_PREFIX, MegatronNames, split_stack_layer
from mega.core.build import build_stage
from mega.core.checkpoint.state import named_parameters
from mega.core.parallel import ParallelConfig
from mega.core.parallel.param_attrs import is_padded_vocab
from mega.core.parallel.plan import Colwise, Rowwise, VocabEmbedding


@dataclass(frozen=True)
class TensorLayout:
    shape: tuple[int, ...]  # global, the vocabulary padded for the layout
    dim: int | None  # tensor-parallel split dimension (None: whole on every rank)
    chunks: int  # blocks split each on their own (SwiGLU's fc1: 2)
    padded_vocab: bool
    trained: bool = True  # False: a frozen parameter (DeepSeek's expert bias), with no optimizer state

    def local_shape(self, tp: int) -> tuple[int, ...]:
        shape = list(self.shape)
        if self.dim is not None:
            shape[self.dim] //= tp
        return tuple(shape)

    def split(self, tensor: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """Rank ``rank``'s shard of the global ``tensor``."""
        if self.dim is None or tp == 1:
            return tensor
        blocks = [block.chunk(tp, self.dim)[rank] for block in tensor.chunk(self.chunks, self.dim)]
        return (blocks[0] if len(blocks) == 1 else torch.cat(blocks, self.dim)).contiguous()

    def merge(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The global tensor from every rank's shard, in rank order."""
        if self.dim is None or len(shards) == 1:
            return shards[0]
        pieces = [shard.chunk(self.chunks, self.dim) for shard in shards]
        return torch.cat([pieces[rank][b] for b in range(self.chunks) for rank in range(len(shards))], self.dim)


def model_layouts(family, config, tp: int) -> dict[str, TensorLayout]:
    """Every parameter of ``family``'s whole model at tensor-parallel size ``tp``, by mega name:
    global shapes from a build on the meta device, splits from the family's parallel plan."""
    try:
        config.validate(tp)
    except ValueError as error:
        raise ConversionError(f"the {family.name} model cannot be split for tensor parallel size {tp}: {error}") \
            from None
    model = build_stage(family, config, parallel=ParallelConfig(tp=tp), device="meta")
    plan = family.tensor_parallel_plan(config, model.stage)
    named, _ = named_parameters([model])
    layouts = {}
    for name, param in named.items():
        module, _, kind = name.rpartition(".")
        styles = [style for pattern, style in plan.items() if fnmatch(module, pattern)]
        dim, chunks = None, 1
        if styles and isinstance(styles[0], Colwise):
            dim, chunks = 0, styles[0].chunks
        elif styles and isinstance(styles[0], Rowwise) and kind == "weight":
            dim = 1
        elif styles and isinstance(styles[0], VocabEmbedding):
            dim = 0
        layouts[name] = TensorLayout(tuple(param.shape), dim, chunks, is_padded_vocab(param), param.requires_grad)
    return layouts


def layers_alike(config) -> bool:
    """Whether megatron-core saves ``config``'s decoder layers stacked under one key per tensor
    (``TransformerBlock.sharded_state_dict``): not when ``--moe-layer-freq`` is a list (first dense
    layers, then MoE ones) or an interval over 1; it then keeps one key per layer."""
    freq = str(getattr(config, "moe_layer_freq", 1)).replace(" ", "").strip("()")
    return freq.isdigit() and int(freq) == 1


def refuse_legacy(names: MegatronNames, family: str, where: str) -> None:
    """A family whose legacy (``--ckpt-format torch``) files mega neither reads nor writes."""
    if not names.legacy_files:
        raise ConversionError(f"{where}: mega reads and writes {family} checkpoints of Megatron-LM as torch_dist "
                              "(--ckpt-format torch_dist), not its legacy files (--ckpt-format torch)")


def stage_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[range]:
    """The global layers of each pipeline stage, as Megatron-LM splits them: evenly, or with
    ``--decoder-first/last-pipeline-num-layers`` set, those on the ends and the rest evenly."""
    counts = [0] * pp
    middle = list(range(pp))
    rest = num_layers
    if first is not None:
        counts[0], rest = first, rest - first
        middle.remove(0)
    if last is not None and pp > 1:
        counts[-1], rest = last, rest - last
        middle.remove(pp - 1)
    if middle:
        if rest % len(middle):
            raise ConversionError(f"{num_layers} layers do not split evenly over {pp} pipeline stages")
        for stage in middle:
            counts[stage] = rest // len(middle)
    elif rest:
        raise ConversionError(f"the first/last stage layer counts do not add up to {num_layers} layers")
    starts = [sum(counts[:stage]) for stage in range(pp)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


def stage_of(name: str, stages: list[range], tied: bool, stack: str = LAYER_PREFIX) -> list[tuple[int, str]]:
    """(stage, name in that stage's files) of each copy of the mega tensor ``name``: layers of the
    ``stack`` split over the stages get their stage-local numbers; a tied embedding is also the
    last stage's ``output_layer.weight``."""
    if len(stages) == 1:  # one stage holds everything under its own name (every stack of layers, too)
        return [(0, name)]
    layer = split_stack_layer(name)
    if layer is not None and layer[0] == stack:
        _, number, rest = layer
        for stage, layers in enumerate(stages):
            if number in layers:
                return [(stage, f"{stack}{number - layers.start}.{rest}")]
        raise ConversionError(f"{name}: layer {number} is in no pipeline stage")
    last = len(stages) - 1
    if name.startswith("embedding."):
        copies = [(0, name)]
        if tied and name == "embedding.word_embeddings.weight" and last > 0:
            copies.append((last, "output_layer.weight"))
        return copies
    return [(last, name)]  # the final norm and the output layer


def _stages(args, num_layers: int, pp: int) -> list[range]:
    return stage_layers(num_layers, pp, getattr(args, "decoder_first_pipeline_num_layers", None),
                        getattr(args, "decoder_last_pipeline_num_layers", None))


def chunk_layers(args, num_layers: int, pp: int, vpp: int) -> dict[tuple[int, int], range]:
    """(pipeline stage, model chunk) -> its global layers. An interleaved pipeline (``vpp`` chunks
    per stage, files holding ``model0``, ``model1``...) cuts the layers into pp x vpp even pieces
    dealt round the stages: chunk v of stage p holds piece v * pp + p."""
    if vpp == 1:
        return {(stage, 0): layers for stage, layers in enumerate(_stages(args, num_layers, pp))}
    for uneven in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(args, uneven, None) is not None:
            raise ConversionError(f"args.{uneven} with virtual_pipeline_model_parallel_size {vpp}: mega reads "
                                  "interleaved pipelines whose layers split evenly")
    pieces = stage_layers(num_layers, pp * vpp)
    return {(stage, chunk): pieces[chunk * pp + stage] for stage in range(pp) for chunk in range(vpp)}


def refuse_split_stacks(names: MegatronNames, pp: int, where: str) -> None:
    """Legacy files of an encoder-decoder split over pipeline stages number each stack per stage
    around ``--pipeline-model-parallel-split-rank``, which mega does not read or write."""
    if pp > 1 and len(names.stacks) > 1:
        raise ConversionError(f"{where}: pipeline_model_parallel_size {pp}; mega reads and writes legacy "
                              "encoder-decoder (T5) files of one pipeline stage (torch_dist ones at any layout)")


def expert_layout(name: str, config) -> TensorLayout:
    """How one expert's matrix (shape left out) is split over tensor-parallel ranks: as the dense
    MLP's (fc1 column-parallel, SwiGLU's gate and up halves each on their own; fc2 row-parallel)."""
    if name.endswith("linear_fc1.weight"):
        return TensorLayout((), 0, 2 if config.swiglu else 1, False)
    return TensorLayout((), 1, 1, False)


def is_stacked_experts(name: str) -> bool:
    """Whether ``name`` is a mixture of experts' stacked expert weights (``...mlp.experts.linear_fc1.weight``)."""
    return ".mlp.experts.linear_fc" in name


def expert_shard_layout(name: str, layout: TensorLayout, config) -> TensorLayout:
    """The layout of one expert's matrix of the stacked ``name`` (split over tp as a dense MLP's)."""
    split = expert_layout(name, config)
    return TensorLayout(layout.shape[1:], split.dim, split.chunks, False)


def global_shape(local: tuple[int, ...], dim: int, tp: int) -> tuple[int, ...]:
    return tuple(size * tp if d == dim else size for d, size in enumerate(local))


def fit_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocabulary rows a layout pads to: cut the source's padding or add zero rows."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
