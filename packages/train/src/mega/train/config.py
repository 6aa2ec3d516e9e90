"""The configuration sections of a training run (besides the model's and ParallelConfig).

Each field declares its Megatron flag once (see mega.core.config.options); `mega train` builds
its parser, TOML loading and `--help` from these classes. Values are checked in
``__post_init__`` so a bad combination fails before any process group or model exists.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from mega.core.checkpoint.config import CheckpointConfig  # noqa: F401  (a section of the run, declared with checkpoints)
from mega.core.config import ConfigError
from mega.core.config.options import option
from mega.core.fp8_recipes import DELAYED, check_fp8_flags
from mega.core.kernels import KernelBackendError, Kernels, check_linear_loss, select_backends
from mega.core.optim.config import OptimizerConfig  # noqa: F401  (a section of the run, declared with the optimizer)
from mega.core.plugins import PluginError


@dataclass
class TrainingConfig:
    model_family: str = option("gpt", "registered model family (see `mega plugins`); with --load, the checkpoint's")
    model_preset: str | None = option(None, "start from a preset of the family (e.g. tiny, 1.3b, llama3-8b); flags override it, and the sizes it derives (kv channels, ffn, query groups) follow the flags")
    micro_batch_size: int = option(1, "samples per micro-batch on each data-parallel rank")
    global_batch_size: int | None = option(
        None, "samples per optimizer step over all ranks (default: micro batch x data-parallel size)"
    )
    gradient_accumulation_steps: int | None = option(
        None, "accepted from DeepSpeed-style scripts; must agree with the global batch size"
    )
    train_iters: int = option(100, "optimizer steps to train")
    exit_interval: int | None = option(
        None, "stop after an iteration divisible by N (saving a checkpoint first under --save)"
    )
    exit_duration_in_mins: float | None = option(
        None, "save a checkpoint and exit 0 once the run has lasted this long (a job's time limit)")
    exit_signal_handler: bool = option(
        False, "on --exit-signal (a scheduler's preemption notice): finish the iteration, save, exit 0")
    exit_signal: Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"] = option(
        "SIGTERM", "the signal --exit-signal-handler acts on")
    seed: int = option(1234, "random seed")
    distributed_timeout_minutes: float = option(
        10, "end the job when a collective does not complete within this time (a hung or stopped rank)"
    )
    eval_interval: int = option(1000, "evaluate every N iterations")
    eval_iters: int = option(10, "micro-batch iterations per evaluation")
    num_layers_per_virtual_pipeline_stage: int | None = option(
        None, "layers per model chunk for interleaved 1F1B (sets the virtual stages per rank)"
    )
    use_mcore_models: bool = option(False, "accepted for Megatron compatibility; has no effect")
    recompute_activations: bool = option(False, "Megatron's shorthand for --recompute-granularity selective")
    group_query_attention: bool = option(False, "accepted for Megatron compatibility; --num-query-groups sets the groups")
    calculate_per_token_loss: bool = option(
        False, "average the loss over every loss token of the global batch (all micro-batches, data- and "
        "context-parallel ranks), not per micro-batch: packed and unpacked rows then train alike")
    skip_failed_plugins: bool = option(False, "train although a plugin failed to load or a callback does not import "
                                       "(they take no part); without it mega train stops before training, naming them")

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "train_iters", "eval_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.eval_iters < 0:
            raise ValueError(f"--eval-iters must be >= 0, got {self.eval_iters}")
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise ValueError(f"--exit-duration-in-mins must be positive, got {self.exit_duration_in_mins}")


@dataclass
class PrecisionConfig:
    bf16: bool = option(False, "bf16 parameters and compute with fp32 main weights")
    fp16: bool = option(False, "fp16 parameters and compute with fp32 main weights and loss scaling")
    accumulate_allreduce_grads_in_fp32: bool | None = option(
        None, "accumulate gradients over micro-batches and all-reduce them in fp32 (default: with --bf16; "
        "--no-accumulate-allreduce-grads-in-fp32 keeps them in the parameters' dtype)",
        action=argparse.BooleanOptionalAction)
    gradient_accumulation_fusion: bool | None = option(
        None, "accumulate each weight gradient into its fp32 main-grad buffer inside the weight-gradient GEMM "
        "(default: on a GPU when gradients accumulate in fp32; the unfused path runs where it cannot)",
        action=argparse.BooleanOptionalAction)
    loss_scale: float | None = option(None, "static loss scale for fp16 (default: dynamic)")
    initial_loss_scale: float = option(2.0**32, "initial dynamic loss scale")
    min_loss_scale: float = option(1.0, "smallest dynamic loss scale")
    loss_scale_window: int = option(1000, "clean steps before the dynamic loss scale grows")
    hysteresis: int = option(2, "overflowing steps tolerated before the loss scale backs off")
    fp8_format: Literal["e4m3", "hybrid"] | None = option(
        None, "FP8 training (Transformer Engine or torchao, by --fp8-recipe): e4m3 everywhere, "
        "or hybrid (E4M3 forward, E5M2 gradients)")
    fp8_hybrid: bool = option(False, "shorthand for --fp8-format hybrid")
    fp8_recipe: Literal["delayed", "tensorwise", "rowwise", "mxfp8", "blockwise"] = option(
        "delayed", "FP8 scaling recipe: delayed (Transformer Engine's amax history), tensorwise or rowwise (current "
        "scaling through torchao, the mega-torchao plugin); mxfp8 and blockwise are refused where no plugin has them")
    first_last_layers_bf16: bool = option(False, "keep the first and last transformer layers out of FP8 "
                                          "(--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16 of them)")
    num_layers_at_start_in_bf16: int = option(1, "with --first-last-layers-bf16: layers at the start kept out of FP8")
    num_layers_at_end_in_bf16: int = option(1, "with --first-last-layers-bf16: layers at the end kept out of FP8")
    fp8_margin: int = option(0, "FP8 scaling margin: scales leave 2^margin of headroom below the format's maximum")
    fp8_amax_compute_algo: Literal["most_recent", "max"] = option("most_recent", "FP8 amax algorithm")
    fp8_amax_history_len: int = option(1, "FP8 amax history length")
    fp8_param_gather: bool = option(False, "keep FP8 parameters and all-gather them in FP8 (refused: the "
                                    "distributed optimizer gathers bf16/fp32 parameters only)")
    transformer_impl: Literal["local", "transformer_engine"] = option(
        "local", "layer implementation: local (mega's kernels), or transformer_engine (--kernels transformer-engine)")
    use_flash_attn: bool = option(False, "use the flash-attn kernel backend for attention")
    tp_comm_overlap: bool = option(False, "overlap tensor-parallel communication with GEMMs (needs Transformer Engine)")

    def __post_init__(self) -> None:
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are mutually exclusive")
        if self.fp8_hybrid and self.fp8_format == "e4m3":
            raise ValueError("--fp8-hybrid means --fp8-format hybrid; it contradicts --fp8-format e4m3")
        if self.num_layers_at_start_in_bf16 < 0 or self.num_layers_at_end_in_bf16 < 0:
            raise ValueError("--num-layers-at-start-in-bf16 and --num-layers-at-end-in-bf16 must be >= 0")

    @property
    def fp8(self) -> str | None:
        """The FP8 format the run trains in (--fp8-format, or hybrid for --fp8-hybrid), None without FP8."""
        return "hybrid" if self.fp8_hybrid else self.fp8_format

    @property
    def dtype_name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    def kernel_request(self) -> str | None:
        """What a precision flag that picks the kernel backends (--use-flash-attn, --transformer-impl
        transformer_engine) needs, in words, for KernelConfig.check to say when it is missing."""
        if self.use_flash_attn:
            return "--use-flash-attn needs the flash-attn kernel plugin and a GPU"
        if self.transformer_impl == "transformer_engine":
            return f"--transformer-impl transformer_engine needs {TRANSFORMER_ENGINE}"
        return None

    def check_kernel_features(self, kernels_name: str | None, plugins) -> None:
        """The FP8 and overlap flags find a kernel backend with what they need, before any work."""
        check_fp8_flags(self, kernels_name, plugins)
        backend = kernels_name and plugins.kernel_backends.get(kernels_name)
        for flag, (feature, asked) in KERNEL_FLAGS.items():
            if feature == "fp8" and self.fp8_recipe != DELAYED:
                continue  # current scaling: check_fp8_flags found the backend with the recipe
            if asked(self) and feature not in getattr(backend, "features", ()):
                raise ConfigError(f"{flag} needs {TRANSFORMER_ENGINE}, or another kernel backend with {feature}")
        if self.fp8_param_gather and self.fp8 is None:
            raise ConfigError("--fp8-param-gather needs --fp8-format (FP8 parameters serve FP8 compute)")
        if self.fp8_param_gather:
            # Megatron builds TE's weights as FP8 tensors (fp8_model_init) and its distributed optimizer
            # casts its fp32 shards into their FP8 bytes and all-gathers those (cast_master_weights_to_fp8);
            # mega's keeps parameters in their own dtype, so there is nothing FP8 to gather yet.
            raise ConfigError("--fp8-param-gather is not supported: it needs FP8 parameter tensors "
                              "(te.pytorch.fp8_model_init) gathered as FP8 bytes by the distributed optimizer, "
                              "which gathers bf16/fp32 parameters only; drop the flag (--fp8-format still "
                              "computes in FP8)")


TRANSFORMER_ENGINE = "NVIDIA Transformer Engine on a GPU (the mega-transformer-engine kernel plugin, --kernels transformer-engine)"
# Flags that need a kernel backend with a capability (KernelBackend.features), and when they are set.
KERNEL_FLAGS = {
    "--fp8-hybrid": ("fp8", lambda precision: precision.fp8_hybrid),
    "--fp8-format": ("fp8", lambda precision: precision.fp8_format is not None),
    "--tp-comm-overlap": ("tp_comm_overlap", lambda precision: precision.tp_comm_overlap),
}


@dataclass
class DataConfig:
    data_path: list[str] | None = option(None, "dataset prefixes, or weight/prefix pairs: w1 p1 w2 p2")
    dataset: str | None = option(
        None, "registered dataset builder (default: gpt with --data-path, mock with --mock-data)"
    )
    split: str = option("969,30,1", "train,valid,test proportions")
    mock_data: bool = option(False, "train on random tokens (no dataset needed)")
    tokenizer_type: str | None = option(None, "registered tokenizer (see `mega plugins`)")
    tokenizer_model: str | None = option(None, "tokenizer model file (SentencePiece, tokenizer.json, ...)")
    vocab_file: str | None = option(None, "vocabulary file")
    merge_file: str | None = option(None, "BPE merges file")
    vocab_extra_ids: int = option(0, "sentinel tokens <extra_id_N> appended to a WordPiece vocabulary (T5: 100)")
    dataloader_type: Literal["single", "cyclic"] = option("single", "single pass or cycling sampler")
    data_cache_path: str | None = option(None, "where sample indices are cached (default: beside the data)")
    mask_prob: float = option(0.15, "share of tokens masked in masked-LM (BERT) and span-corruption (T5) samples")
    short_seq_prob: float = option(0.1, "probability of a shorter target length in BERT and T5 samples")
    sft: bool = option(False, "supervised fine-tuning on `mega preprocess --chat` data (--data-path): one "
                       "conversation per row, only the assistant's tokens in the loss (the sft dataset)")
    packed_sequences: bool = option(False, "with --sft: pack conversations into each --seq-length row (first-fit "
                                    "decreasing); positions restart and attention stays within each conversation "
                                    "(under --context-parallel-size N each is padded to a multiple of 2N)")
    reset_position_ids: bool = option(False, "GPT data: positions restart after every end-of-document token")
    reset_attention_mask: bool = option(False, "GPT data: no token attends across an end-of-document token (under "
                                        "--context-parallel-size too: the rows split as usual, masked by document)")
    eod_mask_loss: bool = option(False, "GPT data: end-of-document tokens are out of the loss")

    def __post_init__(self) -> None:
        if self.packed_sequences and not self.sft:
            raise ValueError("--packed-sequences packs chat data: it needs --sft (for GPT data: "
                             "--reset-position-ids --reset-attention-mask)")

    @property
    def per_document(self) -> bool:
        """Rows hold several documents that each layer must keep apart (every pipeline stage reads
        the batch's ``document_ids`` and ``position_ids``)."""
        return self.packed_sequences or self.reset_attention_mask or self.reset_position_ids


@dataclass
class LoggingConfig:
    log_interval: int = option(10, "print the log line every N iterations")
    tensorboard_dir: str | None = option(None, "write TensorBoard events here")
    log_throughput: bool = option(False, "add tokens/s and TFLOP/s to the log line")
    peak_tflops: float | None = option(None, "device peak TFLOP/s for MFU (default: known GPUs)")
    profile: bool = option(False, "record a torch.profiler trace")
    profile_step_start: int = option(10, "first profiled iteration")
    profile_step_end: int = option(12, "iteration after the last profiled one")
    profile_dir: str = option("profiles", "directory for --profile's Chrome traces (one per rank)")
    pipeline_timeline: str | None = option(None, "write a Chrome trace of the pipeline schedule here")
    wandb_project: str | None = option(None, "log the run to this Weights & Biases project (needs wandb; "
                                       "WANDB_MODE=offline writes it locally)")
    wandb_exp_name: str | None = option(None, "the W&B run's name")
    wandb_save_dir: str | None = option(None, "W&B's directory: its files go to DIR/wandb, as wandb.init(dir=DIR) "
                                        "puts them (default: --save, so --save/wandb; else ./wandb)")
    log_straggler: bool = option(False, "every --log-interval, name the ranks whose step is slowest, with their "
                                 "ratio to the median")
    straggler_minmax_count: int = option(1, "how many of the slowest (and fastest) ranks --log-straggler names")


@dataclass
class KernelConfig:
    """Which registered kernel backend fills each component kind (see mega.core.kernels)."""

    kernels: str | None = option(None, "a kernel backend for every component kind it fills (e.g. liger)")
    attention_backend: str | None = option(None, "attention kernel backend (default torch: sdpa)")
    normalization_backend: str | None = option(None, "LayerNorm/RMSNorm kernel backend")
    linear_backend: str | None = option(None, "linear-layer kernel backend")
    norm_linear_backend: str | None = option(None, "fused norm + linear kernel backend")
    norm_mlp_backend: str | None = option(None, "fused norm + whole MLP kernel backend (e.g. transformer-engine's "
                                          "LayerNormMLP; torch: unfused)")
    activation_backend: str | None = option(None, "MLP activation kernel backend")
    rotary_backend: str | None = option(None, "rotary-embedding kernel backend")
    loss_backend: str | None = option(None, "cross-entropy (loss head) kernel backend")
    block_attention_backend: str | None = option(
        None, "blockwise attention returning the log-sum-exp (context parallelism's ring) kernel backend")
    linear_loss_backend: str | None = option(
        None, "output layer fused with the cross-entropy, no full logits (e.g. liger; torch: unfused)")
    compile: bool | None = option(
        None, "torch.compile each transformer layer (each unit the model family names), fusing its elementwise "
        "chains (bias+GELU/SwiGLU, dropout+residual, RoPE, FP8's casts) (default: on with --fp8-format on a GPU, "
        "where torchao's FP8 is slower than bf16 eager, unless selective recompute runs; --no-compile keeps it "
        "eager)",
        action=argparse.BooleanOptionalAction)
    compile_backend: str = option("inductor", "torch.compile backend for --compile (inductor; aot_eager to "
                                  "check tracing without generating code)")

    def overrides(self) -> dict[str, str | None]:
        return {"attention": self.attention_backend, "norm": self.normalization_backend,
                "linear": self.linear_backend, "norm_linear": self.norm_linear_backend,
                "norm_mlp": self.norm_mlp_backend,
                "activation": self.activation_backend, "rotary": self.rotary_backend, "loss": self.loss_backend,
                "block_attention": self.block_attention_backend, "linear_loss": self.linear_loss_backend}

    def selection(self, plugins=None) -> dict[str, str]:
        """Kind -> backend name; every chosen backend checked usable here (see select_backends)."""
        return select_backends(self.kernels, self.overrides(), plugins)

    def check(self, tp: int, plugins, requested_by: str | None = None) -> None:
        """Every chosen backend is usable here, and the output layer's fused loss (if any) fits
        ``tp``; ``requested_by`` says what the precision flag that chose them needs (PrecisionConfig.kernel_request)."""
        try:
            check_linear_loss(Kernels(self.selection(plugins), plugins), tp)
        except (KernelBackendError, PluginError) as error:
            raise ConfigError(f"{requested_by or '--kernels / --*-backend'}: {error}") from None

    def check_compile(self, model) -> None:
        if self.compile and getattr(model, "recompute_granularity", None) == "selective":
            raise ConfigError("--compile with --recompute-granularity selective (or --recompute-activations): dynamo "
                              "cannot trace the recompute's RNG-tracker context; use full recompute or none")
