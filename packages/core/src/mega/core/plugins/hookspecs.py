"""The hook specifications of mega: every extension point a plugin can fill.

Two kinds of hooks live here.

* Registration hooks are called once when the plugins are loaded. Each receives a
  ``register(name, obj, description="", *, options=None)`` callback; ``obj`` may be the object
  itself or an import path ``"package.module:attribute"`` that is imported only when the name is
  used, so that listing plugins or printing ``mega --help`` never imports torch. ``options`` is a
  dataclass of :func:`mega.core.config.option` fields: flags of ``mega train`` and a TOML table
  named after the plugin (:mod:`mega.core.plugins.options`).

docs/plugins.md states every hook's arguments, return value and the ranks that receive it;
tests/test_plugin_docs.py fails when a signature here changes without that page.

* Event hooks (:class:`EventSpecs`) fire during one training run. Objects implementing them are
  made per run by the factories registered through :func:`register_callbacks`, so a logger or a
  timeline recorder can hold state without module globals.

All hooks take keyword arguments; an implementation may accept any subset of them.
"""

from __future__ import annotations

import pluggy

PROJECT = "mega"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class RegistrationSpecs:
    @hookspec
    def register_models(self, register):
        """Register model families (config presets, builder, parameter-name schema)."""

    @hookspec
    def register_tokenizers(self, register):
        """Register tokenizers under their ``--tokenizer-type`` names."""

    @hookspec
    def register_datasets(self, register):
        """Register dataset builders (e.g. ``gpt``, ``mock``)."""

    @hookspec
    def register_checkpoint_formats(self, register):
        """Register checkpoint formats: objects that load and save a model's state."""

    @hookspec
    def register_kernel_backends(self, register):
        """Register kernel backends: typed component factories (see :mod:`mega.core.kernels`).

        A backend has ``kinds`` (the component kinds it fills), ``component(kind)`` and
        ``is_available() -> tuple[bool, str]`` explaining what is missing.
        """

    @hookspec
    def register_optimizers(self, register):
        """Register optimizers under their ``--optimizer`` names: ``factory(param_groups,
        config: OptimizerConfig) -> torch.optim.Optimizer`` (a fused kernel's optimizer too)."""

    @hookspec
    def register_commands(self, register):
        """Register ``mega`` sub-commands as :class:`mega.core.plugins.Command` objects.

        A name may contain a space (``"bench comm"``) to add a sub-command to a group.
        """

    @hookspec
    def register_setup_passes(self, register):
        """Register passes of the model setup: ``factory(run_config) -> SetupPass | None``.

        The :class:`mega.core.setup_passes.SetupPass` names its phase; every rank runs the passes
        of a run with the family's and the core's in phase order (:func:`mega.core.setup_passes.run_setup`),
        whichever plugin registered them first. ``None``: the pass is not wanted for this run
        (LoRA without ``--lora-rank``).
        """

    @hookspec
    def register_rewards(self, register):
        """Register reward functions under their ``--reward`` names (RL post-training, mega-rl):
        ``fn(prompt=..., completion=..., **fields) -> float`` per completion, or TRL's batched
        ``fn(prompts=[...], completions=[...], **fields) -> list[float]`` (see mega.rl.rewards)."""

    @hookspec
    def register_callbacks(self, register):
        """Register per-run callback factories: ``factory(run_config) -> object | None``.

        The object implements any of the :class:`EventSpecs` hooks; returning ``None`` means the
        callback is not wanted for this run (e.g. TensorBoard without ``--tensorboard-dir``).
        """


class EventSpecs:
    """Events fired by the training loop and the pipeline schedules."""

    @hookspec
    def on_train_start(self, run):
        """Before the first iteration; ``run`` describes the model, groups and config."""

    @hookspec
    def on_train_end(self, run):
        """After the last iteration (also when training stops on an error)."""

    @hookspec
    def on_stage_built(self, stage, groups):
        """This rank's model chunk (``stage``) once every setup pass ran: a listener looks, it
        changes nothing (a change is a setup pass, :meth:`RegistrationSpecs.register_setup_passes`)."""

    @hookspec
    def on_step_start(self, run, iteration):
        """Before the micro-batches of one optimizer step."""

    @hookspec
    def on_step_end(self, run, iteration, metrics):
        """After the optimizer step; ``metrics`` maps names (loss, lr, grad_norm...) to values."""

    @hookspec
    def on_forward_start(self, microbatch, chunk):
        """Before the forward pass of one micro-batch on one model chunk."""

    @hookspec
    def on_forward_end(self, microbatch, chunk):
        """After the forward pass of one micro-batch on one model chunk."""

    @hookspec
    def on_backward_start(self, microbatch, chunk):
        """Before the backward pass of one micro-batch on one model chunk."""

    @hookspec
    def on_backward_end(self, microbatch, chunk):
        """After the backward pass of one micro-batch on one model chunk."""

    @hookspec
    def on_weight_grad_start(self, microbatch, chunk):
        """Before the W step (the deferred weight gradients of a zero-bubble schedule) of one
        micro-batch on one model chunk; its backward hooks then covered the input gradient (B)."""

    @hookspec
    def on_weight_grad_end(self, microbatch, chunk):
        """After the W step of one micro-batch on one model chunk."""

    @hookspec
    def on_p2p_start(self, op, peer, microbatch):
        """Before a pipeline send/receive; ``op`` is e.g. ``"send_forward"``."""

    @hookspec
    def on_p2p_end(self, op, peer, microbatch):
        """After a pipeline send/receive completed."""

    @hookspec
    def on_grad_sync_start(self):
        """Before gradients are reduced across data-parallel ranks."""

    @hookspec
    def on_grad_sync_end(self):
        """After gradients were reduced across data-parallel ranks."""

    @hookspec
    def forward_context(self, microbatch, chunk):
        """A context manager to run one micro-batch's forward on one model chunk in (FP8
        autocast, ...), or None; every listener's are entered, in registration order."""

    @hookspec
    def on_optimizer_step_end(self, run, iteration):
        """After the optimizer applied (or skipped) an update."""

    @hookspec
    def on_eval(self, run, iteration, metrics):
        """After an evaluation pass; ``metrics`` holds loss and perplexity."""

    @hookspec
    def on_checkpoint(self, run, iteration, path):
        """After a checkpoint was completely written."""
