"""What mega-ckpt-convert registers with mega, through the entry-point group ``mega``.

Everything is registered by import path, so ``mega --help`` and ``mega plugins`` import no torch.
"""

from mega.core.plugins import Command, hookimpl


@hookimpl
def register_checkpoint_formats(register):
    register("hf", "mega.ckpt_convert.hf_format:HF_FORMAT",
             "Hugging Face transformers directories (config.json + safetensors + tokenizer) of every family with "
             "a mapping, and Llama-like decoders through the generic bridge (mega convert --list-architectures)")
    register("mega", "mega.ckpt_convert.mega_format:MEGA_FORMAT",
             "mega's sharded checkpoints (mega train --save), read and written at any tp/pp")
    register("megatron", "mega.ckpt_convert.megatron.format:MEGATRON_FORMAT",
             "Megatron-LM save directories, legacy (torch.save per rank) or torch_dist, GPT and LLaMA")


@hookimpl
def register_commands(register):
    register(
        "convert",
        Command(help="convert checkpoints between Hugging Face and mega, or reshard to another tp/pp",
                main="mega.ckpt_convert.cli:main"),
    )
    register(
        "lora",
        Command(help="LoRA adapters of a checkpoint: export-peft (a Hugging Face PEFT adapter) or merge into the base",
                main="mega.ckpt_convert.lora_cli:main"),
    )
