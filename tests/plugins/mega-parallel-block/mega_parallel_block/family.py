"""``parallel-block``: GPT-J / PaLM style layers, y = x + attn(norm(x)) + mlp(norm(x)) + e / L,
where every layer also adds the token embeddings e (scaled by the layer count). So two tensors
cross every pipeline boundary - the hidden states and the embeddings - and both carry gradients
back. Written for one device; the core makes it parallel from the plan below."""

from dataclasses import dataclass

from torch import nn

from mega.core.config.options import option
from mega.core.kernels import CAUSAL
from mega.core.model_family import ModelFamily, TensorSpec, stack_stages
from mega.core.parallel.plan import Colwise, Rowwise, VocabEmbedding


@dataclass(frozen=True)
class BlockConfig:
    num_layers: int = option(4, "parallel blocks")
    hidden_size: int = option(32, "hidden size")
    num_attention_heads: int = option(4, "attention heads")
    ffn_hidden_size: int = option(64, "MLP width")
    seq_length: int = option(16, "tokens per sample")
    vocab_size: int = option(128, "vocabulary size")
    normalization: str = option("RMSNorm", "LayerNorm or RMSNorm")
    init_method_std: float = option(0.02, "std of the weights")

    def validate(self, tensor_parallel_size: int = 1) -> None:
        for flag, value in (("--num-attention-heads", self.num_attention_heads),
                            ("--ffn-hidden-size", self.ffn_hidden_size), ("--vocab-size", self.vocab_size)):
            if value % tensor_parallel_size:
                raise ValueError(f"{flag} {value} is not divisible by the tensor-parallel size {tensor_parallel_size}")


class ParallelBlock(nn.Module):
    def __init__(self, config: BlockConfig, kernels):
        super().__init__()
        h = config.hidden_size
        self.kernels, self.head_dim, self.scale = kernels, h // config.num_attention_heads, 1.0 / config.num_layers
        self.norm = kernels.norm(config.normalization, h, 1e-5)
        self.qkv = kernels.linear(h, 3 * h, bias=False)  # per head [q; k; v]: tp splits whole heads
        self.proj = kernels.linear(h, h, bias=False)
        self.up = kernels.linear(h, config.ffn_hidden_size, bias=False)
        self.down = kernels.linear(config.ffn_hidden_size, h, bias=False)
        self.gelu = kernels.activation("gelu")

    def forward(self, hidden, embedded):
        x = self.norm(hidden)
        seq, batch, _ = x.shape
        q, k, v = self.qkv(x).view(seq, batch, -1, 3 * self.head_dim).split(self.head_dim, dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        context = self.kernels.attention(q, k, v, mask=CAUSAL).permute(2, 0, 1, 3).flatten(2)
        return hidden + self.proj(context) + self.down(self.gelu(self.up(x))) + self.scale * embedded


class BlockStack(nn.Module):
    def __init__(self, config: BlockConfig, stage, kernels, parallel):
        super().__init__()
        self.stage = stage
        vocab, h = config.vocab_size, config.hidden_size
        if stage.is_first:
            self.embedding = nn.Embedding(vocab, h)
        self.layers = nn.ModuleDict({str(n): ParallelBlock(config, kernels) for n in stage.layers["blocks"]})
        if stage.is_last:
            self.final_norm = kernels.norm(config.normalization, h, 1e-5)
            self.head = kernels.linear(h, vocab, bias=False)

    def forward(self, inputs):
        if self.stage.is_first:
            hidden = embedded = self.embedding(inputs["tokens"]).transpose(0, 1).contiguous()
        else:
            hidden, embedded = inputs["hidden"], inputs["embedded"]
        for layer in self.layers.values():
            hidden = layer(hidden, embedded)
        if self.stage.is_last:  # the mean square activation doubles as a small auxiliary loss
            return {"logits": self.head(self.final_norm(hidden)), "activation": hidden.pow(2).mean()}
        return {"hidden": hidden, "embedded": embedded}


def build(config, stage, *, kernels, parallel):
    return BlockStack(config, stage, kernels, parallel)


def plan(config, stage):
    styles = {"layers.*.qkv": Colwise(), "layers.*.proj": Rowwise(), "layers.*.up": Colwise(),
              "layers.*.down": Rowwise()}
    if stage.is_first:
        styles["embedding"] = VocabEmbedding()
    if stage.is_last:
        styles["head"] = Colwise()
    return styles


def init_parameter(config, name):
    if name.endswith("norm.weight"):
        return lambda tensor, generator: tensor.fill_(1.0)
    if name.endswith("norm.bias"):
        return lambda tensor, generator: tensor.zero_()
    return lambda tensor, generator: tensor.normal_(0.0, config.init_method_std, generator=generator)


def boundary(config, stage, micro_batch_size, parallel, dtype):
    shape = (config.seq_length, micro_batch_size, config.hidden_size)
    return {"hidden": TensorSpec(shape, dtype), "embedded": TensorSpec(shape, dtype)}


def loss(outputs, batch, context):
    logits = outputs["logits"]  # [s, b, vocab shard]
    per_token = context.kernels.loss(logits, batch["labels"].transpose(0, 1), context.tp_group).transpose(0, 1)
    mask = batch["loss_mask"]
    lm_loss = (per_token * mask).sum() / mask.sum()
    activation_loss = outputs["activation"]
    return lm_loss + 1e-3 * activation_loss, {"lm loss": lm_loss.detach(), "activation loss": activation_loss.detach()}


def num_parameters(config, tensor_parallel_size=1):
    h, f, v = config.hidden_size, config.ffn_hidden_size, config.vocab_size
    norm = h * (2 if config.normalization == "LayerNorm" else 1)
    return 2 * v * h + config.num_layers * (norm + 4 * h * h + 2 * h * f) + norm


def flops(config, batch_size):
    return 6.0 * num_parameters(config) * batch_size * config.seq_length


FAMILY = ModelFamily(
    name="parallel-block", config_class=BlockConfig, presets={"tiny": BlockConfig()},
    build=build, init_parameter=init_parameter, loss=loss, num_parameters=num_parameters,
    num_floating_point_operations=flops, tensor_parallel_plan=plan, boundary=boundary,
    pipeline_stages=lambda config, pp, vpp: stack_stages(config, pp, vpp, stack="blocks", batch_keys=("tokens",)),
    batch_keys=("tokens", "labels", "loss_mask"), description="parallel attention+MLP blocks",
)
