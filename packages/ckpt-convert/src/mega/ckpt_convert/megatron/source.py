"""A Megatron-LM checkpoint (legacy or torch_dist) as a :class:`~mega.ckpt_convert.source.ModelSource`.

Both formats share what is here: the model comes from the saved ``args``; the tensors the files
hold, renamed to mega's names, are checked against the model those args describe before
anything is converted (a contradiction is an error naming the tensor, its file and the args).
The two readers differ only in how they list and read tensors (:mod:`.read_legacy`,
:mod:`.read_torch_dist`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mega.ckpt_convert.errors import ConversionError
from mega.ckpt_convert.megatron.args import (
    family_of,
    layout_of,
    model_settings,
    shape_args,
    tokenizer_from_args,
)
from mega.ckpt_convert.megatron.bert_args import bert_settings
from mega.ckpt_convert.megatron.layout import TensorLayout, model_layouts
from mega.ckpt_convert.megatron.names.bert import holds_bert
from mega.ckpt_convert.source import TableSource, family_by_name, format_names


class MegatronSource(TableSource):
    """Subclasses set ``_found`` (mega name -> (shape, dtype, file)) and implement ``get``."""

    kind = ""
    allow_unused = False  # --allow-unused-tensors: tensors the model does not use are warned about, not refused

    def _setup(self, directory: Path, args, iteration: int | None, where: str, model_family: str | None,
               file_keys=()) -> None:
        """The model of ``args`` (``file_keys``, the names in the files, tell BERT from GPT)."""
        if not isinstance(args, argparse.Namespace):
            raise ConversionError(f"{where} holds no args (an argparse.Namespace; found {type(args).__name__}); "
                                  "Megatron-LM's save_checkpoint records them, and mega does not guess a model")
        self.directory, self.args, self.iteration = directory, args, iteration
        settings = model_settings(args, where, model_family)
        name = model_family or ("bert" if holds_bert(file_keys) else family_of(settings))
        if name == "bert":
            settings.update(bert_settings(args))
        family = family_by_name(name)
        self.family = family.name
        try:
            self.config = family.config_class(**settings)
        except (TypeError, ValueError) as error:
            raise ConversionError(f"{where}: the args do not make a {family.name} model: {error}") from None
        self.tensor_parallel_size, self.pipeline_parallel_size = layout_of(args)
        self.layouts: dict[str, TensorLayout] = model_layouts(family, self.config, self.tensor_parallel_size)
        self.tokenizer, self.warnings = tokenizer_from_args(args)
        self.tokenizer_extras = {}

    def _check(self, where: str) -> None:
        """The tensors found are the model the args describe: the same names, the same shapes. A
        tensor the model does not have is refused (:meth:`_unused`)."""
        found, layouts = self._found, self.layouts
        missing, unexpected = set(layouts) - set(found), set(found) - set(layouts)
        if missing:
            problems = [f"lacks {format_names(missing)}"] + ([f"holds {format_names(unexpected)}"] if unexpected else [])
            raise ConversionError(f"{where} {' and '.join(problems)}, which the model of its args "
                                  f"({shape_args(self.args)}) does not; the args and the tensors disagree")
        if unexpected:
            self._unused(unexpected, f"which the model of its args ({shape_args(self.args)}) does not have")
            for name in unexpected:
                del found[name]
        padded = getattr(self.args, "padded_vocab_size", None)
        for name, layout in layouts.items():
            shape, _, file = found[name]
            expected = layout.shape
            if layout.padded_vocab:  # the rows Megatron padded to, when the args say
                expected = (padded or shape[0], *layout.shape[1:])
                fits = shape == expected and shape[0] >= self.config.vocab_size
            else:
                fits = shape == expected
            if not fits:
                raise ConversionError(f"{file}: {name} has shape {list(shape)}, but the checkpoint's args "
                                      f"({shape_args(self.args)}) imply {list(expected)}; the args and the "
                                      "tensors disagree")

    def _unused(self, names, why: str) -> None:
        """Tensors of the files that the conversion would not use: an error naming them, or with
        ``allow_unused`` (``--allow-unused-tensors``) a warning, and they are left out."""
        message = f"{self.directory} holds {format_names(names)}, {why}"
        if not self.allow_unused:
            raise ConversionError(f"{message}; the conversion would drop it (--allow-unused-tensors converts "
                                  "without it)")
        self.warnings.append(f"{message}: left out (--allow-unused-tensors)")

    # -- ModelSource ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.layouts)

    def _table(self) -> dict:
        return self._found

    def describe(self) -> list[str]:
        """What ``mega checkpoint info`` prints about the checkpoint."""
        args = self.args
        keep = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "padded_vocab_size", "vocab_size", "seq_length", "position_embedding_type", "normalization", "swiglu",
                "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "expert_model_parallel_size",
                "untie_embeddings_and_output_weights", "add_bias_linear", "params_dtype", "bf16", "fp16",
                "tokenizer_type", "transformer_impl", "encoder_num_layers", "decoder_num_layers",
                "decoder_seq_length", "relative_attention_num_buckets", "bert_binary_head")
        shown = ", ".join(f"{key}={getattr(args, key)}" for key in keep if getattr(args, key, None) is not None)
        dtypes = sorted({str(dtype).removeprefix("torch.") for _, dtype, _ in self._found.values()})
        return [
            f"checkpoint:       {self.directory}",
            f"format:           Megatron-LM {self.kind}",
            f"iteration:        {self.iteration if self.iteration is not None else 'unknown'}",
            f"saved at layout:  tp={self.tensor_parallel_size}, pp={self.pipeline_parallel_size}"
            + (f", vpp={vpp}" if (vpp := getattr(args, "virtual_pipeline_model_parallel_size", None) or 1) > 1 else ""),
            f"model family:     {self.family} (from the args)",
            f"parameters:       {sum(torch.Size(shape).numel() for shape, _, _ in self._found.values()):,} "
            f"({', '.join(dtypes)})",
            f"args:             {shown}",
        ]
