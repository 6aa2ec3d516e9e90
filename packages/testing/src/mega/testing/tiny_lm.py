"""A tiny transformer LM written for one device, and its tensor-parallel plan.

Equivalence tests build it whole from a seed on every rank, split it with
:func:`~mega.core.parallel.tensor_parallel.apply_tensor_parallel` and compare against one
process running the unsplit model. It is deliberately plain: ``nn.Linear`` / ``nn.Embedding`` /
``nn.LayerNorm``, activations ``[s, b, h]``, fused QKV stored per query group as in Megatron
(``[groups, (heads/groups + 2) * head_dim, hidden]``), SwiGLU gate and up fused in one weight.
What depends on the split (local query groups) is read from the weight shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mega.core.parallel.cross_entropy import vocab_parallel_cross_entropy
from mega.core.parallel.groups import Group
from mega.core.parallel.plan import Colwise, Rowwise, SequenceParallelOutput, VocabEmbedding

PLAN = {
    "embedding": SequenceParallelOutput(),
    "embedding.word_embeddings": VocabEmbedding(),
    "layers.*.linear_qkv": Colwise(),
    "layers.*.linear_proj": Rowwise(),
    "layers.*.linear_fc1": Colwise(chunks=2),
    "layers.*.linear_fc2": Rowwise(),
    "output_layer": Colwise(),
}

MLP_PLAN = {"linear_fc1": Colwise(), "linear_fc2": Rowwise()}


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 128
    hidden: int = 32
    heads: int = 8
    query_groups: int = 4
    ffn: int = 64
    layers: int = 2
    seq: int = 16


class Embedding(nn.Module):
    def __init__(self, config: TinyConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab, config.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(tokens).transpose(0, 1).contiguous()  # [b, s] -> [s, b, h]


class Block(nn.Module):
    def __init__(self, config: TinyConfig):
        super().__init__()
        self.head_dim = config.hidden // config.heads
        self.queries_per_group = config.heads // config.query_groups
        qkv_rows = config.query_groups * (self.queries_per_group + 2) * self.head_dim
        self.input_norm = nn.LayerNorm(config.hidden)
        # No QKV bias: the key bias has an exactly zero gradient (softmax ignores a per-row
        # constant), and Adam turns that rounding noise into full-size steps that differ per layout.
        self.linear_qkv = nn.Linear(config.hidden, qkv_rows, bias=False)
        self.linear_proj = nn.Linear(config.heads * self.head_dim, config.hidden)
        self.mlp_norm = nn.LayerNorm(config.hidden)
        self.linear_fc1 = nn.Linear(config.hidden, 2 * config.ffn)
        self.linear_fc2 = nn.Linear(config.ffn, config.hidden)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.linear_qkv(x)
        s, b = qkv.shape[:2]
        per_group = self.queries_per_group + 2
        groups = qkv.shape[-1] // (per_group * self.head_dim)  # local query groups
        qkv = qkv.view(s, b, groups, per_group, self.head_dim)
        q = qkv[:, :, :, : self.queries_per_group].reshape(s, b, -1, self.head_dim)
        k = qkv[:, :, :, -2].repeat_interleave(self.queries_per_group, dim=2)
        v = qkv[:, :, :, -1].repeat_interleave(self.queries_per_group, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.linear_proj(self.attention(self.input_norm(x)))
        gate, up = self.linear_fc1(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.linear_fc2(F.silu(gate) * up)


class TinyLM(nn.Module):
    def __init__(self, config: TinyConfig):
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.final_norm = nn.LayerNorm(config.hidden)
        self.output_layer = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, tp: Group) -> torch.Tensor:
        """Mean next-token loss; ``tokens`` and ``labels`` are ``[b, s]``."""
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.output_layer(self.final_norm(x))  # [s, b, V/tp]
        return vocab_parallel_cross_entropy(logits, labels.t(), tp).mean()


class TinyMLP(nn.Module):
    def __init__(self, hidden: int = 32, ffn: int = 64):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, ffn)
        self.linear_fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def make_batch(config: TinyConfig, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``tokens`` and ``labels`` of shape ``[batch, seq]``, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.vocab, (batch, config.seq + 1), generator=generator)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()
