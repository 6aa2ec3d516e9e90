"""``HostCopy``: device tensors copied to host memory without waiting for the device, read later.

A decode loop that read each step's tokens at once would wait, every token, for the device to
finish the step (a host synchronisation per token: on a GPU the time between graph replays).
Instead the step's tokens (and log-probabilities) are copied into pinned host buffers with
``non_blocking`` copies and an event recorded behind them; the host goes on launching the next
steps and reads a copy only a few steps later (:class:`~mega.inference.engine.decode_step.DecodeStep`),
when the device has long passed it, so waiting on its event costs nothing.

On CPU the same code runs: the copies are plain (synchronous) and there is no event.
"""

from __future__ import annotations

import torch


class HostCopy:
    """Copies of ``tensors`` on their way to the host; :meth:`read` gives them as lists."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._event = None
        self._host: dict[str, torch.Tensor] = {}
        on_gpu = any(t.device.type == "cuda" for t in tensors.values())
        for name, tensor in tensors.items():
            # Pinned memory: a device-to-host copy into it runs in the stream's order, without the host waiting.
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=on_gpu)
            self._host[name] = buffer.copy_(tensor, non_blocking=on_gpu)
        if on_gpu:
            self._event = torch.cuda.Event()
            self._event.record()

    def read(self) -> dict[str, list]:
        """The copied values (waits for the copies where they still run)."""
        if self._event is not None:
            self._event.synchronize()
        return {name: tensor.tolist() for name, tensor in self._host.items()}


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host ``values`` as a tensor on ``device``, without waiting for the device's queue (a copy
    from pinned memory on CUDA: one from ordinary memory may wait for the stream)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
