"""Which path a layer's attention and storage writes take: the Triton kernels, the CPU kernel or the
torch reference.

The choice is made once per layer, from the device its first tensors arrive on, so ``auto`` does
the right thing for a model on a GPU and for the same code on a laptop: Triton on CUDA tensors, the
C++ decode kernel (:mod:`hfkv.kernels.cpu`, built on first use) on CPU tensors, and the torch
reference on a CPU where no C++ compiler can build that kernel. ``cpu`` changes only the decode
step's attention; storage writes and policy runs are the torch backend's.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from hfkv.config import BACKENDS


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
        import triton

        version = triton.__version__
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in (version.split(".") + ["0"])[:2])
    return major, minor


def cpu_kernel_available() -> bool:
    from hfkv.kernels.cpu.build import available

    return available()


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(requested: str, device: torch.device | str) -> str:
    """``auto``: triton on CUDA tensors (when triton is installed), the CPU kernel on CPU tensors (when it
    builds), torch elsewhere; ``triton`` and ``cpu``: checked."""
    device = torch.device(device)
    if requested not in BACKENDS:
        raise ValueError(f"TriStateConfig.backend={requested!r} is not a backend; allowed: {BACKENDS}")
    if requested == "torch":
        return "torch"
    if requested == "auto":
        if device.type == "cuda" and triton_available():
            return "triton"
        return "cpu" if device.type == "cpu" and cpu_kernel_available() else "torch"
    if requested == "cpu":
        if device.type != "cpu":
            raise ValueError(
                f"TriStateConfig.backend='cpu' runs on CPU tensors, but this cache's tensors are on "
                f"{device.type!r}; use backend='auto' (Triton on CUDA) or 'torch'"
            )
        from hfkv.kernels.cpu.build import library

        library()  # raises CpuKernelUnavailable, naming the compiler and its error
        return "cpu"
    if not triton_available():
        raise ValueError(
            "TriStateConfig.backend='triton' needs the triton package (pip install triton), which is not "
            "installed; use backend='torch' or 'auto'"
        )
    if device.type != "cuda" and interpreter_on() and _compiled_kernels_loaded():
        raise ValueError(
            "TriStateConfig.backend='triton' on a CPU tensor: TRITON_INTERPRET=1 is set, but hfkv's kernels were "
            "imported before it was, as GPU kernels. Set TRITON_INTERPRET=1 before importing hfkv (e.g. in the "
            "shell), or use backend='torch'."
        )
    if device.type != "cuda" and not interpreter_on():
        raise ValueError(
            f"TriStateConfig.backend='triton' runs on CUDA tensors, but this cache's tensors are on "
            f"{device.type!r}. Move the model to a GPU, use backend='auto' or 'torch', or set "
            "TRITON_INTERPRET=1 before importing hfkv to run the kernels in Triton's CPU interpreter "
            "(slow; meant for tests)."
        )
    return "triton"


def _compiled_kernels_loaded() -> bool:
    """Whether the decode kernels were already decorated as GPU kernels (the variable came too late)."""
    module = sys.modules.get("hfkv.kernels.decode_attention")
    if module is None:
        return False
    return type(module._partial_kernel).__name__ != "InterpretedFunction"
