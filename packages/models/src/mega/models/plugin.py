"""What mega-models registers with mega, through the entry-point group ``mega``.

Everything is registered by import path, so listing plugins or ``mega --help`` never imports torch.
"""

from mega.core.plugins import hookimpl


@hookimpl
def register_models(register):
    register("gpt", "mega.models.gpt.family:FAMILY", "GPT-2/GPT-3 (tiny ... 175b)")
    register("llama", "mega.models.llama.family:FAMILY", "LLaMA-2 7b/13b/70b, LLaMA-3 8b/70b/405b")
    register("t5", "mega.models.t5.family:FAMILY", "T5 encoder-decoder: v1.0 small/base/large, v1.1 base")
    register("mixtral", "mega.models.mixtral.family:FAMILY", "Mixtral mixture of experts (tiny, 8x7b, 8x22b)")
    register("qwen3", "mega.models.qwen3.family:FAMILY", "Qwen3 dense 0.6b ... 32b (LLaMA with QK-norm)")
    register("qwen3-moe", "mega.models.qwen3_moe.family:FAMILY", "Qwen3-MoE 30b-a3b, 235b-a22b (QK-norm, top-8 of 128 experts)")
    register("qwen3-next", "mega.models.qwen3_next.family:FAMILY",
             "Qwen3-Next 80b-a3b (Gated DeltaNet linear attention 3:1 with gated attention, shared + routed experts)")
    register("gpt-oss", "mega.models.gpt_oss.family:FAMILY", "gpt-oss 20b, 120b (attention sinks, alternating "
             "sliding windows, YaRN, clamped SwiGLU experts)")
    register("deepseek-v3", "mega.models.deepseek_v3.family:FAMILY",
             "DeepSeek-V3 671b (MLA, shared + sigmoid-routed experts, MTP), v2-lite shape")
    register("bert", "mega.models.bert.family:FAMILY", "BERT base/large, MiniLM-L6 (masked-LM encoder, embeddings)")


@hookimpl
def register_kernel_backends(register):
    register("torch", "mega.models.torch_kernels:TORCH",
             "torch-native attention (sdpa), norms, linear, activations, rotary, cross-entropy")


@hookimpl
def register_callbacks(register):
    register("moe-expert-bias", "mega.models.moe.expert_bias:expert_bias_update",
             description="aux-loss-free MoE balancing: each step moves the experts' routing bias towards an even load "
                         "(--moe-router-enable-expert-bias)")


@hookimpl
def register_setup_passes(register):
    register("lora", "mega.models.lora.training:lora_pass",
             "adapters: LoRA beside the linear layers, the base frozen (--lora-rank)",
             options="mega.models.lora.training:LoRAOptions")
