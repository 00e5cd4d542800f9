"""Compile every kernel configuration the cache launches for a GPU target, on a machine without a GPU.

Triton's interpreter checks what the kernels compute, not whether they compile: types, layouts,
``tl.dot`` shapes and shared-memory use are only checked by the real compiler. Triton ships the
CUDA compiler chain (``ptxas``), so each launch the wrappers would make can be captured on the CPU
(arguments and compile-time constants, without running anything) and compiled to a cubin for
Hopper (``sm_90``) here. ``tests/test_kernels_compile.py`` runs this in a process without
``TRITON_INTERPRET``; on a GPU machine the kernel tests run the compiled kernels themselves.

    python -m hfkv.kernels.aot_check        # prints one line per compiled configuration
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hfkv.kernels.backend import interpreter_on

_SIG = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
}


@contextmanager
def captured_launches() -> Iterator[list[tuple[Any, tuple, dict]]]:
    """Within the block, ``kernel[grid](...)`` records ``(kernel, args, kwargs)`` instead of launching."""
    from triton.runtime.jit import JITFunction

    calls: list[tuple[Any, tuple, dict]] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        calls.append((self, args, kwargs))

    JITFunction.run = record
    try:
        yield calls
    finally:
        JITFunction.run = original


def _signature(fn, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    values = dict(zip(fn.arg_names, args, strict=False)) | kwargs
    constexprs = {p.name for p in fn.params if p.is_constexpr}
    sig, consts = {}, {}

    def kind(name: str, v: Any) -> Any:
        if isinstance(v, tuple):  # a tuple argument (one part's pointers and sizes): a tuple of types
            return tuple(kind(name, x) for x in v)
        if isinstance(v, torch.Tensor):
            return "*" + _SIG[v.dtype]
        if isinstance(v, bool):
            return "i1"
        if isinstance(v, int):
            return "i64" if abs(v) >= 2**31 else "i32"
        if isinstance(v, float):
            return "fp32"
        raise TypeError(f"aot_check: argument {name}={v!r} of {fn.__name__} has no signature type")

    for name in fn.arg_names:
        v = values[name]
        if name in constexprs or v is None:
            sig[name], consts[(fn.arg_names.index(name),)] = "constexpr", v
        else:
            sig[name] = kind(name, v)
    return sig, consts


def compile_calls(calls: list[tuple[Any, tuple, dict]], arch: int = 90) -> list[dict]:
    """Compile captured launches for ``cuda:sm_<arch>``; one record per distinct configuration."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    seen, out = set(), []
    for fn, args, kwargs in calls:
        sig, consts = _signature(fn, args, kwargs)
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted((k[0], repr(v)) for k, v in consts.items())))
        if key in seen:
            continue
        seen.add(key)
        kernel = triton.compile(ASTSource(fn, sig, consts), target=target)
        names = {i: n for i, n in enumerate(fn.arg_names)}
        out.append(
            {
                "kernel": fn.__name__,
                "constexprs": {names[k[0]]: v for k, v in consts.items() if v is not None},
                "shared_bytes": kernel.metadata.shared,
                "cubin_bytes": len(kernel.asm["cubin"]),
            }
        )
    return out


# (key, value, model dtype, head_dim, GQA ratio, query lengths): every tier format and model dtype once,
# the shipped presets' tiers at Llama's head_dim 128 / GQA 4 (decode and a chunk), a non-power-of-two group.
CASES = [
    ("int4", "int2", torch.bfloat16, 128, 4, (1, 20)),
    ("int8", "int4", torch.bfloat16, 128, 4, (1,)),
    ("fp8", "fp8", torch.bfloat16, 128, 4, (1,)),
    ("int2", "int2", torch.float16, 64, 1, (1,)),
    ("int4", "int4", torch.float32, 64, 3, (1, 3)),
]


def representative_calls() -> list[tuple[Any, tuple, dict]]:
    """The launches of a decode step, a chunk, encodes and moves, for every tier format and model dtype."""
    if interpreter_on():
        raise RuntimeError("aot_check compiles GPU kernels: run it without TRITON_INTERPRET=1")
    from hfkv.kernels.decode_attention import DenseSlots, PagedSlots, paged_attention
    from hfkv.kernels.encode import encode_write
    from hfkv.kernels.move import clear_tags, move_records
    from hfkv.quant.formats import QuantFormat
    from hfkv.storage import PagedTiers, RecordLayout

    calls: list = []
    for key, value, dtype, dim, ratio, qlens in CASES:
        lay = (
            RecordLayout(QuantFormat("model", dim, 32, dtype), QuantFormat("model", dim, 32, dtype)),
            RecordLayout(QuantFormat(key, dim, 32, dtype), QuantFormat(value, dim, 32, dtype)),
        )
        tiers = PagedTiers(lay, 1, 2, None)
        for t in range(2):
            tiers.append(t, torch.zeros(1, 2, 3, lay[t].nbytes, dtype=torch.uint8), torch.ones(1, 2, 3).bool())
        ring = torch.zeros(1, 2, 24, dim, dtype=dtype)
        win = DenseSlots(ring, ring, torch.arange(24), torch.zeros(1, 2, 24))
        parts = [win] + [PagedSlots(tiers.pool.data, tiers.tables[t], tiers.tpp[t], lay[t]) for t in range(2)]
        with captured_launches() as got:
            for qlen in qlens:
                query = torch.zeros(1, 2 * ratio, qlen, dim, dtype=dtype)
                paged_attention(query, parts, 40, torch.zeros(1, dtype=torch.long), 0.1, "max", return_delta=False)
            rows = torch.zeros(2, dim, dtype=dtype)
            for t in range(2):
                encode_write(tiers.pool.data, torch.zeros(2, dtype=torch.long), lay[t], rows, rows,
                             torch.zeros(2, dtype=torch.long), torch.zeros(2))  # fmt: skip
            move_records(tiers.pool.data, torch.zeros(1, dtype=torch.long), torch.ones(1).long() * 4, 8)
            clear_tags(tiers.pool.data, torch.zeros(1, dtype=torch.long))
        calls += got
    return calls


def main(report: Callable[[str], None] = print) -> int:
    done = compile_calls(representative_calls())
    for r in done:
        report(f"{r['kernel']:<22} shared {r['shared_bytes']:>6} B  cubin {r['cubin_bytes']:>7} B  {r['constexprs']}")
    report(f"{len(done)} kernel configurations compiled for sm_90")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
