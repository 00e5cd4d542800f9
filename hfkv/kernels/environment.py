"""What this machine offers the kernels: Triton (its version, its CPU interpreter, whether inline PTX may be used)
and a C++ compiler for the CPU kernels. Read by the kernels when they are defined and by
:func:`hfkv.kernels.backend.resolve_backend` when a layer picks its backend."""

from __future__ import annotations

import importlib.util
import os

import torch

from hfkv.kernels.cpu.build import available


def interpreter_on() -> bool:
    """Triton's CPU interpreter: read when a kernel is decorated, so it must be set before hfkv.kernels loads."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def inline_ptx_ok() -> bool:
    """Whether the kernels may use their inline PTX (the operand fence, the fp16 dequantization's arithmetic): code
    compiled for NVIDIA GPUs. The interpreter runs no inline assembly and a ROCm build of torch compiles for AMD
    GPUs; both get the same arithmetic written in Triton."""
    return not interpreter_on() and getattr(torch.version, "hip", None) is None


def triton_version(version: str | None = None) -> tuple[int, int]:
    """The installed Triton's (or ``version``'s) (major, minor): code shapes that help one compiler hurt another
    (``OPERAND_FENCE``)."""
    if version is None:
        import triton  # optional: triton (installed on Linux x86-64 only)

        version = triton.__version__
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in (version.split(".") + ["0"])[:2])
    return major, minor


def cpu_kernel_available() -> bool:
    return available()


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
