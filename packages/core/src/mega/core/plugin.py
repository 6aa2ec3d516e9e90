"""What mega-core itself registers, through the same entry point a third party uses."""

from mega.core.plugins import Command, hookimpl


@hookimpl
def register_commands(register):
    register(
        "plugins",
        Command(
            help="list installed plugins and what they registered",
            main="mega.core.cli.plugins_command:main",
        ),
    )
    register(
        "train",
        Command(
            help="pretrain a GPT/LLaMA-style model at any parallel layout (Megatron's flags)",
            main="mega.core.training.command:main",
        ),
    )
    register(
        "checkpoint info",
        Command(
            help="show a checkpoint's iteration, layout, model, size and completeness",
            main="mega.core.checkpoint.info_command:main",
        ),
    )
    register(
        "checkpoint verify",
        Command(
            help="check that checkpoints are unchanged since saved (sizes and checksums)",
            main="mega.core.checkpoint.verify_command:main",
        ),
    )
    register(
        "plan",
        Command(
            help="memory per GPU, FLOPs and step time of a run before launching it; --search for layouts",
            main="mega.core.planning.plan_command:main",
        ),
    )
    register(
        "doctor",
        Command(
            help="check driver, CUDA, NCCL, torch, GPUs, NVLink topology, plugins and environment",
            main="mega.core.doctor.command:main",
        ),
    )
    register(
        "bench train",
        Command(
            help="baseline report: step time, tokens/s, TFLOP/s, MFU and memory per precision",
            main="mega.core.bench.train:main",
        ),
    )
    register(
        "bench comm",
        Command(
            help="measure collectives (all_reduce, all_gather, ...) the nccl-tests way",
            main="mega.core.bench.comm:main",
        ),
    )


@hookimpl
def register_callbacks(register):
    register(
        "console",
        "mega.core.training.console_log:console_logger",
        description="Megatron's log line every --log-interval iterations",
    )
    register(
        "tensorboard",
        "mega.core.training.tensorboard_log:tensorboard_logger",
        description="TensorBoard scalars under Megatron's tags (--tensorboard-dir)",
    )
    register(
        "wandb",
        "mega.core.training.wandb_log:wandb_logger",
        description="Weights & Biases: the log line's metrics and the run's configuration (--wandb-project)",
    )
    register(
        "exit-signal",
        "mega.core.training.exit_signal:exit_before_the_end",
        description="save and exit 0 on a preemption signal or before --exit-duration-in-mins runs out",
    )
    register(
        "hang-report",
        "mega.core.training.hang_report:hang_watch",
        description="records each rank's collectives; on a collective timeout every rank reports what it was doing",
    )
    register(
        "straggler",
        "mega.core.training.straggler:straggler_report",
        description="names the slowest ranks and their ratio to the median every --log-interval (--log-straggler)",
    )
    register(
        "restart-progress",
        "mega.core.training.in_job_restart:progress_file",
        description="rank 0's last finished iteration, for --max-restarts' report of the iterations a failure cost",
    )
    register(
        "profiler",
        "mega.core.training.profiler:step_profiler",
        description="torch.profiler Chrome trace of chosen iterations (--profile)",
    )
    register(
        "pipeline-timeline",
        "mega.core.pipeline.timeline:timeline_callback",
        description="Chrome trace of every rank's pipeline schedule (--pipeline-timeline PATH)",
    )


@hookimpl
def register_optimizers(register):
    register("adam", "mega.core.optim.torch_optimizers:adam", "AdamW (decoupled weight decay), Megatron's adam")
    register("sgd", "mega.core.optim.torch_optimizers:sgd", "SGD with momentum")
    register("muon", "mega.core.optim.muon:muon",
             "Muon (Newton-Schulz orthogonalised momentum) for hidden matrices, AdamW for the rest")
