"""The memory-budget allocation on CPU tensors: :func:`hfkv.policy.budget.allocate`'s decisions, by the C++
selection of ``allocate.cpp`` (why select and not sort: that file's header).

:func:`hfkv.policy.budget.allocate` is the torch twin; the tests compare the two on random rows, ties,
caps, floors, sinks and both head modes. The cache calls this one for ``backend='cpu'``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache

import torch
from torch import Tensor

from hfkv.kernels.cpu.build import library
from hfkv.policy.budget import Costs, check_tiers, item_tables
from hfkv.policy.unified import Sinks, check_shapes, head_row, rows_of, sink_mask
from hfkv.states import ORIGINAL

__all__ = ["allocate_cpu"]


@cache
def _kernel():
    fn = library().hfkv_allocate
    ptr, i32, f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float
    fn.argtypes = [ptr] * 9 + [i32] * 4 + [ptr] * 4 + [f32, f32, i32, ptr]
    fn.restype = None
    return fn


@cache
def _tables(cost: tuple, fidelity: tuple) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    on = check_tiers(cost, fidelity)
    present, rate, step_cost, target = item_tables(cost, fidelity, on, torch.device("cpu"))
    exact_rate = float(fidelity[ORIGINAL]) / int(cost[ORIGINAL])
    return (
        present.to(torch.uint8).contiguous(),
        rate.contiguous(),
        step_cost.contiguous(),
        target.contiguous(),
        exact_rate,
    )


def allocate_cpu(
    scores: Tensor,
    state: Tensor,
    sink: Tensor | Sinks,
    logical_len: Tensor | int,
    alpha_h: Tensor,
    alpha_l: Tensor,
    room: Tensor | int,
    cost: Costs,
    fidelity: Sequence[float | None],
    head_adaptive: bool,
    exact_cap: Tensor | None = None,
    prior: float = 0.0,
) -> Tensor:
    """:func:`hfkv.policy.budget.allocate` (same arguments, same result) for CPU tensors."""
    b, h, n = check_shapes(scores, state, sink)
    present, rate, step_cost, target, exact_rate = _tables(tuple(cost), tuple(fidelity))
    rows = (b,) if head_adaptive else (b, h)
    room = rows_of(room, rows, "room")
    sink = sink_mask(sink, state)
    if isinstance(logical_len, int):
        logical_len = torch.full((b,), logical_len, dtype=torch.int64)
    if exact_cap is not None and tuple(exact_cap.shape) != rows:
        raise ValueError(f"exact_cap must have shape {rows}, got {tuple(exact_cap.shape)}")
    if scores.device.type != "cpu":
        raise ValueError(f"allocate_cpu: tensors must be on the CPU, got scores on {scores.device}")
    k = step_cost.numel()
    if n * (h if head_adaptive else 1) * k >= 2**31:  # the C++ items index a row's (token, item) pairs in 32 bits
        raise ValueError(f"allocate_cpu: {n} tokens x {h if head_adaptive else 1} heads x {k} items a row exceed "
                         f"2**31 - 1; allowed: fewer (token, item) pairs per row")  # fmt: skip
    out = torch.empty((b, h, n), dtype=torch.int8)
    if n == 0:
        return out
    args = [
        scores.to(torch.float32).contiguous(),
        state.to(torch.int8).contiguous(),
        sink.to(torch.uint8).contiguous(),
        logical_len.to(torch.int64).reshape(b).contiguous(),
        head_row(alpha_h, h, scores.device),
        head_row(alpha_l, h, scores.device),
        room.to(torch.int64).contiguous(),
        None if exact_cap is None else exact_cap.to(torch.int64).contiguous(),
        torch.tensor([0 if c is None else int(c) for c in cost], dtype=torch.int64),
    ]
    _kernel()(
        *(None if t is None else t.data_ptr() for t in args),
        b, h, n, k,
        present.data_ptr(), rate.data_ptr(), step_cost.data_ptr(), target.data_ptr(),
        exact_rate, float(prior), int(head_adaptive), out.data_ptr(),
    )  # fmt: skip
    return out
