"""Numbers a kernel wrote, read by the host later than they were asked for, so the read drains nothing.

A policy run reads a few counts back once (its movers' total, the pages each tier frees and takes). Read at once,
the host waits for every launch queued before them and the GPU then idles while the host launches the rest of the
run. Asked for a step ahead (``TriStateLayer``'s run ahead) the copy is queued behind the kernels that write the
numbers and read a step later, by when it has long landed in pinned host memory: the wait is an event's, already
passed, and the queue stays full.
"""

from __future__ import annotations

import torch

__all__ = ["HostRead"]


class HostRead:
    """``tensor``'s values on their way to the host: queued now (no wait), read by :meth:`tolist`, which waits only
    for the copy itself. A CPU tensor is read where it is (the caller must not write it before the read)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor

    def tolist(self) -> list:
        if self._event is not None and not self._event.query():  # landed already: no synchronising call at all
            self._event.synchronize()
        return self._host.tolist()
