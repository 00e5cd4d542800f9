"""A guard for the decode path: no host number goes into a device tensor, none comes back."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NoHostScalars"]


class NoHostScalars(TorchDispatchMode):
    """Raises on the ops that move a host number into a device tensor or read one back.

    ``x[i] = 5`` lifts the number into a CPU scalar tensor and copies it to the device: on CUDA a
    synchronous copy from pageable memory, and an error inside CUDA-graph capture. On a CPU these
    ops are the only trace of it, so the dry run and the tests can catch it there.
    """

    BANNED = ("aten.lift_fresh", "aten._local_scalar_dense")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        scalar_copy = name.startswith("aten.copy_") and isinstance(args[1], torch.Tensor) and args[1].dim() == 0
        if name.startswith(self.BANNED) or scalar_copy:
            raise AssertionError(f"host scalar on the decode path: {name}")
        return func(*args, **(kwargs or {}))
