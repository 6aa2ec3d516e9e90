"""The backward split in two: B (the input gradient) now, W (the weight gradients) later.

Zero-bubble pipeline schedules run a micro-batch's backward as two steps: B computes the
gradient the previous stage waits for, W the weight gradients, which nothing waits for and so
fill the pipeline's bubbles. A linear layer's backward is three products; B does ``grad_input
= grad_output @ W``, W does ``grad_W += grad_output^T @ input`` (and the bias gradient).

A layer whose forward runs inside ``with deferring_weight_grads(pending):`` computes only the
input gradient in its backward and appends the weight-gradient product (a closure over the saved
input and the incoming gradient) to ``pending``; :func:`run_weight_grads` (the W step) runs them.
The choice is made at forward time and kept on the autograd node, so it holds whatever thread
autograd runs the backward on (under ``--compile`` the deferring layers run eagerly between the
compiled pieces of a layer while a region is open: :func:`eager_while_deferring`); the weights enter the node detached, so autograd accumulates
nothing into them (and runs none of their hooks) until W. The context is a ``ContextVar`` scoped
by the ``with``, as ``torch.no_grad`` is: nothing to reset. Layers that defer: mega's linears (the torch ``linear`` component
and the tensor-parallel linears, all through :func:`~mega.core.parallel.grad_accumulation_fusion.linear`)
the grouped MoE experts (the loop over experts and the ``torch._grouped_mm`` path) and the torchao
plugin's FP8 linears (each calls :func:`defer` from its backward); other weights (norms, embeddings,
Transformer Engine's linears) get their gradients in B as before, which changes only when. Activation recompute reruns a region with the deferral its forward had
(:func:`replaying_weight_grad_deferral`).

W hands each summed gradient to autograd as the gradient of the parameter itself, so it lands
where the backward would have put it (``.grad``) and the parameter's post-accumulate hooks fire:
the data-parallel wrapper moves it into ``main_grad`` and starts a bucket's reduce when the
bucket's last gradient (its last W) is in. Under gradient-accumulation fusion the product is
accumulated straight into ``main_grad`` (``weight.grad_added_to_main_grad``), as the fused
backward does. The gradients equal the unsplit backward's: the same products of the same
tensors, only later.

Memory: a pending W holds each deferred layer's input and output gradient (in a transformer
layer about as much as its forward saved for backward: a GPT layer 16 h floats per token against
15 h, a LLaMA layer about 4/5 of it, without dropout), and W frees them product by product, handing each parameter's gradient over as
soon as the last product naming it (:func:`defer`'s ``parameters``) has run: it never holds all of
a stage's weight gradients at once. The output layer's W holds less than that: it rebuilds the
logits' gradient from the hidden and the loss's per-token statistics
(:mod:`mega.core.parallel.output_layer_loss`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar

import torch

# A deferred product: called at W, returns (parameter, gradient) pairs; gradient None means it
# was accumulated into the parameter's main_grad already (gradient-accumulation fusion).
WeightGrad = Callable[[], list[tuple[torch.Tensor, torch.Tensor | None]]]
# What ``pending`` holds: each product with the parameters it names (None: not named).
Deferred = tuple[WeightGrad, tuple[torch.Tensor, ...] | None]

_pending: ContextVar[tuple[list[Deferred], frozenset[int]] | None] = ContextVar(
    "mega_deferred_weight_grads", default=None)
# How many deferring regions are open in this process (any thread): a plain global, which
# compiled code can read (it guards on its value), where the ContextVar it cannot.
_open_regions = 0
_open_regions_lock = threading.Lock()


def deferring_anywhere() -> bool:
    """Whether a deferring region is open in this process. Dynamo guards on the count, so a
    compiled layer keeps one graph for forwards inside such regions and one for the others."""
    return _open_regions > 0


def eager_while_deferring(function: Callable) -> Callable:
    """``function`` (a layer's product that may defer its weight gradients), run eagerly
    (``torch.compiler.disable``) when called from compiled code while a deferring region is open:
    there :func:`deferral_target` can read the region, so W gets the products of compiled layers
    too; the rest of the layer stays compiled around it."""
    eager = torch.compiler.disable(function)

    @functools.wraps(function)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling() and deferring_anywhere():
            return eager(*args, **kwargs)
        return function(*args, **kwargs)

    return run


@contextlib.contextmanager
def _region(context: tuple[list[Deferred], frozenset[int]] | None) -> Iterator[None]:
    """``context`` set for the layers run inside, and counted while open if it defers."""
    global _open_regions
    token = _pending.set(context)
    counted = int(context is not None)
    with _open_regions_lock:
        _open_regions += counted
    try:
        yield
    finally:
        with _open_regions_lock:
            _open_regions -= counted
        _pending.reset(token)


@contextlib.contextmanager
def deferring_weight_grads(pending: list[Deferred], keep_in_b: Iterable[torch.Tensor] = ()
                           ) -> Iterator[list[Deferred]]:
    """Layers whose forward runs inside leave their weight gradients to ``pending``, except for
    the weights ``keep_in_b``: a weight that also gets an ordinary gradient in B (a word
    embedding tied to the output layer of the same rank) must get all of it there, or the
    data-parallel wrapper would reduce its bucket before W adds the rest."""
    with _region((pending, frozenset(id(weight) for weight in keep_in_b))):
        yield pending


def deferral_target(*weights: torch.Tensor) -> list[Deferred] | None:
    """Where a layer run now puts the weight-gradient products of ``weights`` (None: compute
    them in B)."""
    if torch.compiler.is_compiling():  # first: dynamo cannot trace a ContextVar's get (eager_while_deferring)
        return None
    context = _pending.get()
    if context is None or not torch.is_grad_enabled():
        return None
    pending, kept = context
    return None if any(id(weight) in kept for weight in weights) else pending


def replaying_weight_grad_deferral() -> contextlib.AbstractContextManager:
    """Called where a region's forward runs: a context that puts back, while activation recompute
    reruns the region in backward, whether (and where) its layers deferred their weight gradients,
    so the recomputed operations save the same tensors as the first run."""
    if torch.compiler.is_compiling():  # a compiled region defers nothing (see deferral_target)
        return contextlib.nullcontext()
    return _region(_pending.get())  # (a compiled layer rerun inside then takes its deferring graph)


def defer(pending: list[Deferred], product: WeightGrad,
          parameters: Sequence[torch.Tensor | None] | None = None) -> None:
    """Called by a layer's backward: run ``product`` at the W step. ``parameters``: those it gives
    gradients to, so that W hands each one over (and frees its operands) as soon as its last product
    has run; a product that does not name them keeps every gradient of its W until the end."""
    named = None if parameters is None else tuple(p for p in parameters if p is not None)
    pending.append((product, named))


def run_weight_grads(pending: list[Deferred]) -> None:
    """The W step: every deferred product, summed per parameter, handed to autograd once per
    parameter (so its hooks fire once), as soon as the last product naming it has run: a layer's
    operands (its input and output gradient) and its gradient go as soon as they are used, so W
    never holds more than the weight gradients of the parameters still being summed."""
    items = list(pending)
    pending.clear()
    named = all(parameters is not None for _, parameters in items)
    last_use: dict[int, int] = {}
    if named:
        for index, (_, parameters) in enumerate(items):
            for parameter in parameters:
                last_use[id(parameter)] = index
    summed: dict[int, list] = {}
    for index in range(len(items)):
        product, _ = items[index]
        items[index] = None  # the operands go with the product once it has run
        _add_product(summed, product)
        del product
        ready = [key for key in summed if last_use.get(key, len(items)) <= index]
        _hand_over([summed.pop(key) for key in ready])
    _hand_over(list(summed.values()))


def _add_product(summed: dict[int, list], product: WeightGrad) -> None:
    """Add ``product``'s gradients to ``summed`` (``id(parameter) -> [parameter, sum]``)."""
    with torch.no_grad():  # the products are a backward's: no graph of their own
        for parameter, grad in product():
            entry = summed.setdefault(id(parameter), [parameter, None])
            if grad is not None:
                entry[1] = grad if entry[1] is None else entry[1].add_(grad)  # products are fresh tensors


def _hand_over(entries: list) -> None:
    """Give autograd each ``[parameter, summed gradient]``: it accumulates them and fires the hooks."""
    if not entries:
        return
    parameters, grads = [], []
    for parameter, grad in entries:
        if grad is None:  # fused into main_grad: an uninitialised placeholder fires the hooks
            parameter.grad_added_to_main_grad = True
            grad = torch.empty_like(parameter)
        parameters.append(parameter)
        grads.append(grad)
    torch.autograd.backward(parameters, grad_tensors=grads)
