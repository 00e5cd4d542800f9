"""Grid sizes on the host.

``triton.cdiv`` is a constexpr function object in recent Triton: a host call costs ~2 us (a plain division
~0.05 us), and a policy run sizes a handful of grids, each of 32 layers' runs on a GPU's critical path.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers (``b > 0``)."""
    return -(-a // b)
