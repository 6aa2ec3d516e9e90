"""What mega-train registers, through the same entry point a third party uses: the commands that
train, plan, check and measure runs, and the training loop's own callbacks."""

from mega.core.plugins import Command, hookimpl


@hookimpl
def register_commands(register):
    register(
        "train",
        Command(
            help="pretrain a GPT/LLaMA-style model at any parallel layout (Megatron's flags)",
            main="mega.train.command:main",
        ),
    )
    register(
        "checkpoint info",
        Command(
            help="show a checkpoint's iteration, layout, model, size and completeness",
            main="mega.train.checkpoint.info_command:main",
        ),
    )
    register(
        "checkpoint verify",
        Command(
            help="check that checkpoints are unchanged since saved (sizes and checksums)",
            main="mega.train.checkpoint.verify_command:main",
        ),
    )
    register(
        "plan",
        Command(
            help="memory per GPU, FLOPs and step time of a run before launching it; --search for layouts",
            main="mega.train.planning.plan_command:main",
        ),
    )
    register(
        "doctor",
        Command(
            help="check driver, CUDA, NCCL, torch, GPUs, NVLink topology, plugins and environment",
            main="mega.train.doctor.command:main",
        ),
    )
    register(
        "bench train",
        Command(
            help="baseline report: step time, tokens/s, TFLOP/s, MFU and memory per precision",
            main="mega.train.bench.train:main",
        ),
    )
    register(
        "bench comm",
        Command(
            help="measure collectives (all_reduce, all_gather, ...) the nccl-tests way",
            main="mega.train.bench.comm:main",
        ),
    )
    register(
        "launch slurm",
        Command(
            help="write an sbatch script for a multi-node job (one task per GPU); --submit runs sbatch",
            main="mega.train.job_launchers.command:slurm_main",
        ),
    )
    register(
        "launch k8s",
        Command(
            help="write Kubernetes manifests for a multi-node job: a Kubeflow PyTorchJob and a JobSet",
            main="mega.train.job_launchers.command:k8s_main",
        ),
    )
    register(
        "plugins new",
        Command(
            help="write a new plugin distribution to start from (--kind model, kernels, callback, ...)",
            main="mega.train.scaffold.command:main",
        ),
    )


@hookimpl
def register_callbacks(register):
    register(
        "pipeline-timeline",
        "mega.train.pipeline_timeline:timeline_callback",
        description="Chrome trace of every rank's pipeline schedule (--pipeline-timeline PATH)",
    )
    register(
        "console",
        "mega.train.console_log:console_logger",
        description="Megatron's log line every --log-interval iterations",
    )
    register(
        "tensorboard",
        "mega.train.tensorboard_log:tensorboard_logger",
        description="TensorBoard scalars under Megatron's tags (--tensorboard-dir)",
    )
    register(
        "wandb",
        "mega.train.wandb_log:wandb_logger",
        description="Weights & Biases: the log line's metrics and the run's configuration (--wandb-project)",
    )
    register(
        "exit-signal",
        "mega.train.exit_signal:exit_before_the_end",
        description="save and exit 0 on a preemption signal or before --exit-duration-in-mins runs out",
    )
    register(
        "hang-report",
        "mega.train.hang_report:hang_watch",
        description="records each rank's collectives; on a collective timeout every rank reports what it was doing",
    )
    register(
        "straggler",
        "mega.train.straggler:straggler_report",
        description="names the slowest ranks and their ratio to the median every --log-interval (--log-straggler)",
    )
    register(
        "restart-progress",
        "mega.train.in_job_restart:progress_file",
        description="rank 0's last finished iteration, for --max-restarts' report of the iterations a failure cost",
    )
    register(
        "profiler",
        "mega.train.profiler:step_profiler",
        description="torch.profiler Chrome trace of chosen iterations (--profile)",
    )


@hookimpl
def register_setup_passes(register):
    register("compile", "mega.train.model_passes:compile_pass",
             "compile: each transformer layer through torch.compile (--compile, --compile-backend)")
    register("weight-tying", "mega.train.model_passes:weight_tying_pass",
             "weight tying: the last pipeline stage's LM head starts as the first stage's embedding")
    register("data-parallel", "mega.train.model_passes:data_parallel_pass",
             "data parallel: DDP (with the distributed optimizer's buffers) or FSDP2 (--use-torch-fsdp2, "
             "--data-parallel-sharding-strategy)")
