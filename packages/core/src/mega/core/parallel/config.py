"""``ParallelConfig``: how many ways each parallel dimension is split, checked before any group exists."""

from __future__ import annotations

from dataclasses import dataclass

from mega.core.config.options import option

# How attention crosses the context group (mega.models.blocks.context_attention has one function each).
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


class ParallelConfigError(ValueError):
    """A layout that cannot be built on the given world size."""


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the parallel dimensions; data parallelism takes whatever the world has left.

    ``tp`` tensor, ``pp`` pipeline, ``cp`` context, ``ep`` expert parallel; ``etp`` the experts'
    own tensor-parallel size (None: ``tp``), a divisor of ``tp``; ``vpp`` virtual
    pipeline chunks per stage (interleaved 1F1B); ``sequence_parallel`` splits the non-tensor-
    parallel regions (norms, dropout) along the sequence over the tensor-parallel group;
    ``cp_comm_type``: how attention crosses the context group (:mod:`mega.models.blocks.context_attention`).
    """

    tp: int = option(1, "tensor-parallel size", flag="--tensor-model-parallel-size")
    pp: int = option(1, "pipeline-parallel size (stages)", flag="--pipeline-model-parallel-size")
    cp: int = option(1, "context-parallel size", flag="--context-parallel-size")
    ep: int = option(1, "expert-parallel size", flag="--expert-model-parallel-size")
    etp: int | None = option(
        None, "tensor-parallel size of the experts (a divisor of --tensor-model-parallel-size; default: "
        "that size). Experts then spread over tp/etp times more ranks: --expert-model-parallel-size must "
        "divide dp*cp*tp/etp", flag="--expert-tensor-parallel-size"
    )
    vpp: int | None = option(
        None, "model chunks per pipeline rank (interleaved 1F1B)", flag="--num-virtual-stages-per-pipeline-rank"
    )
    sequence_parallel: bool = option(
        False, "split norms and dropout along the sequence over the tensor-parallel group"
    )
    cp_comm_type: str = option(
        "p2p", "how attention crosses the context group: p2p (ring attention), all_gather (gather keys "
        "and values), a2a (Ulysses: trade the sequence split for a head split)", choices=CP_COMM_TYPES
    )

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size (``etp``, default ``tp``)."""
        return self.tp if self.etp is None else self.etp

    def features_asked(self) -> dict[str, tuple[str, str]]:
        """The flags set here that need a feature of the model family (``ModelFamily.features``):
        flag -> (feature, what the flag needs in words); see ``mega.core.model_family.check_features``."""
        asked = {"--expert-model-parallel-size": ("moe", "> 1 needs an MoE model family", self.ep > 1),
                 "--expert-tensor-parallel-size": ("moe", "needs an MoE model family", self.etp is not None),
                 "--context-parallel-size": ("context_parallel", "> 1 needs a model family with context "
                                             "parallelism", self.cp > 1)}
        return {flag: (feature, needs) for flag, (feature, needs, set_) in asked.items() if set_}

    def data_parallel_size(self, world_size: int) -> int:
        self.validate(world_size)
        return world_size // (self.tp * self.cp * self.pp)

    def validate(self, world_size: int) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ParallelConfigError(f"{name} must be a positive integer, got {value!r}")
        if world_size < 1:
            raise ParallelConfigError(f"world size must be positive, got {world_size}")
        model_parallel = self.tp * self.cp * self.pp
        if model_parallel > world_size:
            raise ParallelConfigError(
                f"tp*cp*pp = {self.tp}*{self.cp}*{self.pp} = {model_parallel} is larger than "
                f"the world size {world_size}"
            )
        if world_size % model_parallel:
            raise ParallelConfigError(
                f"world size {world_size} is not divisible by tp*cp*pp = "
                f"{self.tp}*{self.cp}*{self.pp} = {model_parallel}"
            )
        dp = world_size // model_parallel
        self._validate_expert_layout(dp)
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ParallelConfigError(f"cp_comm_type must be one of {', '.join(CP_COMM_TYPES)}, "
                                      f"got {self.cp_comm_type!r}")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise ParallelConfigError(f"vpp must be a positive integer, got {self.vpp!r}")
            if self.vpp > 1 and self.pp == 1:
                raise ParallelConfigError(
                    f"vpp = {self.vpp} (virtual pipeline stages) needs pp > 1, got pp = {self.pp}"
                )

    def _validate_expert_layout(self, dp: int) -> None:
        """Experts are laid out ``etp-ep-dp-pp`` over the same world (Megatron's expert rank
        generator): ep must divide what is left of tp*cp*dp after etp."""
        etp = self.expert_tp
        if etp == self.tp:  # experts split like the dense layers, spread over dp*cp
            if (dp * self.cp) % self.ep:
                raise ParallelConfigError(
                    f"--expert-model-parallel-size: ep = {self.ep} must divide dp*cp = {dp}*{self.cp} = "
                    f"{dp * self.cp} (world size {dp * self.cp * self.tp * self.pp}, tp={self.tp}, pp={self.pp})"
                )
            return
        if not isinstance(etp, int) or etp < 1 or self.tp % etp:
            raise ParallelConfigError(
                f"--expert-tensor-parallel-size {etp!r} must be a positive divisor of "
                f"--tensor-model-parallel-size {self.tp}"
            )
        if not self.sequence_parallel:
            raise ParallelConfigError(
                f"--expert-tensor-parallel-size {etp} differs from --tensor-model-parallel-size {self.tp}: "
                "this needs --sequence-parallel (each group of etp ranks runs the experts on its own "
                "slice of the sequence)"
            )
        spread = dp * self.cp * (self.tp // etp)
        if spread % self.ep:
            raise ParallelConfigError(
                f"--expert-model-parallel-size: ep = {self.ep} must divide dp*cp*tp/etp = "
                f"{dp}*{self.cp}*{self.tp}/{etp} = {spread} (--expert-tensor-parallel-size {etp})"
            )
