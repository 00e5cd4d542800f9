"""How many kernel instances hfkv's Triton kernels have compiled in this process, so a timed step that compiled
one can be told apart from one that did not.

A Triton kernel compiles once per specialisation (argument dtypes, integers equal to 1 or divisible by 16,
constexprs), the first time it meets it: seconds on a GPU. A timing that meets a new specialisation midway (the
ninth lease's policy profile: a policy run of 2.75 s after two warm-up runs) is no step's cost, and a run that
counts compiles before and after each step can say so instead of folding it into a mean.
"""

from __future__ import annotations

import sys

__all__ = ["compiled_kernels"]


def compiled_kernels() -> int:
    """Instances compiled so far by every Triton kernel in the imported ``hfkv.kernels`` modules (0 under the
    interpreter, which compiles nothing)."""
    try:
        from triton.runtime.jit import JITFunction  # optional: triton (installed on Linux x86-64 only)
    except ImportError:
        return 0
    total = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("hfkv.kernels.") or module is None:
            continue
        for obj in vars(module).values():
            if isinstance(obj, JITFunction):
                # device_caches[device] = (kernel_cache, kernel_key_cache, target, backend, binder) (Triton 3.6-3.9)
                total += sum(len(entry[0]) for entry in obj.device_caches.values())
    return total
