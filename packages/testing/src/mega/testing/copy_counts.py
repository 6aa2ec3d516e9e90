"""Count the ops of a forward and backward pass that only move memory: contiguity copies
(``clone``, ``copy_``), ``cat`` and dtype conversions (``_to_copy``), overall and within given
modules.

The counter is a ``TorchDispatchMode``: it sees every ATen op the autograd layer dispatches,
forward and backward, on any device, after composite ops are broken up (``reshape`` that cannot
view shows as ``clone``, ``repeat_interleave`` as ``clone``, ``.to(dtype)`` as ``_to_copy``).
Ops inside a fused kernel (an SDPA kernel's own copies) are not seen. An op is attributed to a
module when it runs inside the module's forward, or in the backward of an autograd node that
forward made (the nodes between its output and its inputs).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# What each counted ATen op is counted as.
KINDS = {"clone": "copy", "copy_": "copy", "cat": "cat", "_to_copy": "convert"}


class CopyCounts(TorchDispatchMode):
    """``counts[(kind, phase)]`` over the whole run and ``scoped[(kind, phase)]`` within the modules
    ``within`` (kind: copy, cat, convert; phase: forward, backward); ``ops[name]``: every ATen op
    by name (``"cos"``, ``"mm"``), counted or not; ``device_ops[name]`` and
    ``scoped_device_ops[name]``: the forward's ops that are not views (each a kernel on a GPU: what
    a captured decode step replays), overall and within ``within``."""

    def __init__(self, within: Iterable[nn.Module] = ()):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.scoped: collections.Counter = collections.Counter()
        self.ops: collections.Counter = collections.Counter()
        self.device_ops: collections.Counter = collections.Counter()
        self.scoped_device_ops: collections.Counter = collections.Counter()
        self._depth = 0
        self._nodes: set = set()
        self._handles = []
        for module in within:
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave, with_kwargs=True))

    def _enter(self, module, args):
        self._depth += 1

    def _leave(self, module, args, kwargs, output):
        self._depth -= 1
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        self._nodes |= _nodes_between(output, inputs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        node = torch._C._current_autograd_node()
        if node is None and not _is_view(func):
            self.device_ops[name] += 1
            if self._depth > 0:
                self.scoped_device_ops[name] += 1
        kind = KINDS.get(name)
        if kind is not None:
            phase = "forward" if node is None else "backward"
            self.counts[kind, phase] += 1
            if (node is None and self._depth > 0) or (node is not None and node in self._nodes):
                self.scoped[kind, phase] += 1
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return super().__exit__(*exc)


def _is_view(func) -> bool:
    """An op whose output aliases its input without writing it (a view: no kernel runs)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _nodes_between(output: torch.Tensor, inputs: list[torch.Tensor]) -> set:
    """The autograd nodes from ``output`` back to (not including) those that made ``inputs``."""
    stop = {t.grad_fn for t in inputs if t.grad_fn is not None}
    nodes, todo = set(), [output.grad_fn] if isinstance(output, torch.Tensor) else []
    while todo:
        node = todo.pop()
        if node is None or node in stop or node in nodes:
            continue
        nodes.add(node)
        todo.extend(parent for parent, _ in node.next_functions)
    return nodes


def count_copies(step: Callable[[], None], within: Iterable[nn.Module] = ()) -> CopyCounts:
    """Run ``step()`` (a forward and its backward) under a :class:`CopyCounts`."""
    with CopyCounts(within) as counter:
        step()
    return counter
