"""Compile every kernel configuration the cache launches for a GPU target, on a machine without a GPU.

Triton's interpreter checks what the kernels compute, not whether they compile: types, layouts,
``tl.dot`` shapes and shared-memory use are only checked by the real compiler. Triton ships the
CUDA compiler chain (``ptxas``), so each launch the wrappers would make can be captured on the CPU
(arguments and compile-time constants, without running anything) and compiled to a cubin for
Hopper (``sm_90``) here. ``tests/test_kernels_compile.py`` runs this in a process without
``TRITON_INTERPRET``; on a GPU machine the kernel tests run the compiled kernels themselves.

    python -m eval.gpu.aot        # from the repository root; prints one line per compiled configuration
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hfkv.kernels.environment import interpreter_on


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


def _specialized(fn, backend, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, Any]:
    """Signature, constants, attributes and options exactly as ``JITFunction.run`` derives them.

    A hand-built signature misses what the launcher specialises on its own (an integer argument equal
    to 1, or inside a tuple, becomes a compile-time constant; pointers divisible by 16 get alignment
    attributes), and the first GPU run failed on a path only that specialisation reaches. So the
    launch's own binder and packer are used, with the target's backend in place of the device's.
    """
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return signature, constexprs, attrs, options


def _target(arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", arch, 32)
    return target, make_backend(target)


def _compile(fn, specialized: tuple, target):
    import triton
    from triton.compiler import ASTSource

    sig, consts, attrs, options = specialized
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=options.__dict__)


def compile_launch(fn, args: tuple, kwargs: dict, arch: int = 90):
    """One captured launch compiled for ``cuda:sm_<arch>``: the compiled kernel (``asm['cubin']``, ``metadata``)."""
    target, backend = _target(arch)
    return _compile(fn, _specialized(fn, backend, args, kwargs), target)


def compile_calls(calls: list[tuple[Any, tuple, dict]], arch: int = 90) -> list[dict]:
    """Compile captured launches for ``cuda:sm_<arch>``; one record per distinct configuration."""
    target, backend = _target(arch)
    seen, out = set(), []
    for fn, args, kwargs in calls:
        specialized = _specialized(fn, backend, args, kwargs)
        sig, consts, attrs, _ = specialized
        key = (fn.__name__, repr(sorted(sig.items())), repr(sorted(consts.items())), repr(sorted(attrs.items())))
        if key in seen:
            continue
        seen.add(key)
        kernel = _compile(fn, specialized, target)
        names = dict(enumerate(fn.arg_names))
        out.append(
            {
                "kernel": fn.__name__,
                "constexprs": {names[k[0]]: v for k, v in consts.items() if len(k) == 1 and v is not None},
                "shared_bytes": kernel.metadata.shared,
                "cubin_bytes": len(kernel.asm["cubin"]),
                "global_loads": global_loads(kernel.asm["ptx"]),
            }
        )
    return out


def global_loads(ptx: str) -> dict[str, int]:
    """Global load instructions in the PTX, by bytes per thread and instruction (``async8``: a ``cp.async``
    of 8 bytes into shared memory, ``ld2``: a 2-byte load). One-element loads where the code reads rows
    mean the compiler could not prove the rows aligned (the alignment hints in ``load_field``)."""
    counts: dict[str, int] = {}
    for m in re.finditer(r"ld\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.[bufs](\d+)\b", ptx):
        key = f"ld{int(m.group(1) or 1) * int(m.group(2)) // 8}"
        counts[key] = counts.get(key, 0) + 1
    for m in re.finditer(r"cp\.async\.c[ag]\.shared\.global[^;]*?\],\s*(0x[0-9a-f]+|\d+)", ptx):
        key = f"async{int(m.group(1), 0)}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


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
    from hfkv.kernels.gather import gather_decode
    from hfkv.kernels.meta import read_candidates_triton, read_meta_triton
    from hfkv.kernels.move import clear_tags, compact, move_records, release_pages, remove_tiers
    from hfkv.kernels.reserve import count_appends, reserve_slots
    from hfkv.quant.formats import QuantFormat
    from hfkv.quant.record import RecordLayout
    from hfkv.storage import PagedTiers

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
                for int_tile in (False, True) if qlen == 1 else (False,):
                    paged_attention(query, parts, 40, torch.zeros(1, dtype=torch.long), 0.1, "max",
                                    return_delta=False, int_tile=int_tile)  # fmt: skip
                if dtype != torch.float32:  # fp32 dequantization (HALF_DEQUANT off), no fence, no PTX, code products
                    for option in ({"half_dequant": False}, {"operand_fence": False}, {"asm_dequant": False},
                                   {"code_dots": 3}):  # fmt: skip
                        paged_attention(query, parts, 40, torch.zeros(1, dtype=torch.long), 0.1, "max",
                                        return_delta=False, **option)  # fmt: skip
            rows = torch.zeros(2, dim, dtype=dtype)
            for t in range(2):
                for shape in ((None, None), (16, 1)):  # the default launch and a prompt-sized one
                    encode_write(tiers.pool.data, torch.zeros(2, dtype=torch.long), lay[t], rows, rows,
                                 torch.zeros(2, dtype=torch.long), torch.zeros(2), *shape)  # fmt: skip
            move_records(tiers.pool.data, torch.zeros(1, dtype=torch.long), torch.ones(1).long() * 4, 8)
            clear_tags(tiers.pool.data, torch.zeros(1, dtype=torch.long))
            for mean_over in (None, (40, 3)):  # score sums, and their means (score_mode="mean")
                read_candidates_triton(tiers.pool.data, tiers.tables, tiers.counts, tiers.tpp, lay, [5, 5],
                                       torch.arange(4), torch.zeros(1, 2, 4), torch.zeros(1, dtype=torch.long),
                                       mean_over)  # fmt: skip
            # a run's removals (every tier a part: one instance whichever tiers lose tokens)
            remove_tiers(tiers.pool.data, tiers.tables, tiers.counts, torch.zeros(1, 2, 9, dtype=torch.int8), [3, 3],
                         [True, True], tiers.tpp, lay, tiers.pool.free_stack, tiers.pool.n_free)  # fmt: skip
            remove_tiers(tiers.pool.data, [*tiers.tables, tiers.tables[1]],
                         torch.cat([tiers.counts, tiers.counts[..., 1:]], -1).contiguous(),
                         torch.zeros(1, 2, 9, dtype=torch.int8), [3, 3, 3], [True, False, True],
                         [*tiers.tpp, tiers.tpp[1]], (*lay, lay[1]), tiers.pool.free_stack,
                         tiers.pool.n_free)  # fmt: skip
            # three tiers (a mid one): the candidates kernel's third part
            read_candidates_triton(tiers.pool.data, [*tiers.tables, tiers.tables[1]],
                                   torch.cat([tiers.counts, tiers.counts[..., 1:]], -1), [*tiers.tpp, tiers.tpp[1]],
                                   (*lay, lay[1]), [5, 5, 5], torch.arange(4), torch.zeros(1, 2, 4),
                                   torch.zeros(1, dtype=torch.long))  # fmt: skip
            for t in range(2):
                read_meta_triton(tiers.pool.data, tiers.tables[t], tiers.counts[..., t], tiers.tpp[t], lay[t], 5)
                keep = torch.ones(1, 2, 3, dtype=torch.bool)
                new = compact(tiers.pool.data, tiers.tables[t], tiers.counts[..., t], keep, tiers.tpp[t], lay[t])
                release_pages(tiers.tables[t], tiers.counts[..., t].clone(), new, tiers.tpp[t], tiers.pool.free_stack,
                              tiers.pool.n_free)  # fmt: skip
                one = torch.zeros(1, dtype=torch.long)
                gather_decode(tiers.pool.data, tiers.tables[t], tiers.tpp[t], lay[t], one, one, one)
                out = (torch.zeros(1, dim), torch.zeros(1, dim), one.clone(), torch.zeros(1))
                gather_decode(tiers.pool.data, tiers.tables[t], tiers.tpp[t], lay[t], one, one, one, (one, t), out)
                count_appends(one, one, tiers.counts[..., t].clone(), tiers.tpp[t])
                reserve_slots(tiers.pool.data, tiers.tables[t], tiers.counts[..., t].reshape(-1),
                              torch.ones(2, dtype=torch.long), torch.zeros(1, dtype=torch.int32), tiers.tpp[t],
                              lay[t].stride, 2)  # fmt: skip
                # a planned run's: the counts set by the reservation (entering per head as the plan's int32)
                reserve_slots(tiers.pool.data, tiers.tables[t], tiers.counts[..., t].reshape(-1).clone(),
                              torch.ones(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), tiers.tpp[t],
                              lay[t].stride, 2, tiers.counts[..., t])  # fmt: skip
        calls += got
    calls += _allocate_calls()
    from hfkv.kernels.changes import tier_changes
    from hfkv.kernels.moves import EXIT, gather_exits, place_moves, plan_moves
    from hfkv.kernels.observation import observation_scores, oq_score_triton

    with captured_launches() as got:
        for sizes in ([3], [3, 2], [3, 2, 1]):
            tier_changes(torch.zeros(1, 2, 8, dtype=torch.int8), torch.ones(1, 2, 8, dtype=torch.bool), sizes)
            # a move plan's launches: its count (recorded here, so it reads zeros back) and its placing of 10 movers
            new, valid = torch.zeros(1, 2, 8, dtype=torch.int8), torch.ones(1, 2, 8, dtype=torch.bool)
            counts = torch.zeros(1, 2, len(sizes), dtype=torch.long)
            plan_moves(new, valid, sizes, counts, [4] * len(sizes))
            plan_moves(new, valid, sizes, counts, [4] * len(sizes), ([520] * len(sizes), 2))  # and the tier peak
            place_moves(new, valid, sizes, torch.zeros(len(sizes), 2, dtype=torch.int32), [10] + [0] * (len(sizes) - 1))
        for dtype in (torch.bfloat16, torch.float16, torch.float32):  # the exits' model dtypes
            kv = torch.zeros(1, 2, 4, 128, dtype=dtype)
            one = torch.zeros(1, dtype=torch.long)
            gather_exits(kv, kv, one, torch.zeros(1, 2, 4), one, one, one + EXIT, one,
                         (torch.zeros(1, 128), torch.zeros(1, 128), one.clone(), torch.zeros(1)))  # fmt: skip
        # a prompt's observation scores: Llama-3.1-8B (groups of 4), SmolLM2 (groups of 3, dim 64), a head dim of 80
        for hq, h, dim, dtype in ((32, 8, 128, torch.bfloat16), (9, 3, 64, torch.bfloat16), (4, 2, 64, torch.float32),
                                  (8, 2, 80, torch.bfloat16)):  # fmt: skip
            for reduction in ("max", "mean", "l2"):
                key = torch.zeros(1, h, 40, dim, dtype=dtype)
                observation_scores(torch.zeros(1, hq, 40, dim, dtype=dtype), key, 0.1, 32, reduction)
        oq_score_triton(torch.zeros(2, 40), torch.ones(2, 40, dtype=torch.bool), (7.7, 5.4, 5.5))
    return calls + got


def _allocate_calls() -> list[tuple[Any, tuple, dict]]:
    """The budget allocation's launches: per head and head-adaptive, with and without the exact cap, two and
    three tiers, sinks, length and room as tensors and as a policy run passes them (``Sinks``, ints). Without the
    fast path, so the scan and the decision are always captured: launches captured are not run, and the fast
    path's answer would be read from an unwritten buffer (which made the count of compiled configurations vary
    between runs, 163 to 170)."""
    from hfkv.kernels.allocate import allocate_triton
    from hfkv.policy.unified import Sinks

    n = 5
    with captured_launches() as got:
        for adaptive in (False, True):
            rows = (1,) if adaptive else (1, 2)
            for cap in (None, torch.ones(rows, dtype=torch.long)):
                for cost, fidelity in (((520, 264, 88), (1.0, 0.95, 0.6)), ((520, None, 88), (1.0, None, 0.6))):
                    for run in (False, True):
                        sink = Sinks(torch.zeros(1, 2, n, dtype=torch.long), torch.ones(1, dtype=torch.long)) if run \
                            else torch.zeros(1, 2, n, dtype=torch.bool)  # fmt: skip
                        allocate_triton(torch.zeros(1, 2, n), torch.zeros(1, 2, n, dtype=torch.int8), sink,
                                        n if run else torch.full((1,), n), torch.tensor(float("inf")),
                                        torch.tensor(0.0), -1 if run else torch.full(rows, -1), cost, fidelity,
                                        adaptive, cap, 1.0, fast_path=False)  # fmt: skip
    return got


def decode_instances(sizes: tuple[int, ...] = (1, 3, 16, 17, 33, 64, 100), arch: int = 90) -> dict[str, int]:
    """How many kernel instances a layer's decode steps compile as its storage and position change.

    Each size is a different state between two policy runs (tokens per tier, ring slot and position
    of the new token); the answer per kernel must be 1, or a policy run on a GPU pays a compile (seconds)
    instead of a launch. Counted with the launcher's own specialisation (:func:`_specialized`).
    """
    if interpreter_on():
        raise RuntimeError("aot_check compiles GPU kernels: run it without TRITON_INTERPRET=1")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from hfkv.kernels.decode_attention import DenseSlots, PagedSlots, paged_attention
    from hfkv.quant.formats import QuantFormat
    from hfkv.quant.record import RecordLayout
    from hfkv.storage import PagedTiers
    from hfkv.storage.window import PendingWrite

    dim, dtype = 128, torch.bfloat16
    lay = (
        RecordLayout(QuantFormat("model", dim, 32, dtype), QuantFormat("model", dim, 32, dtype)),
        RecordLayout(QuantFormat("int4", dim, 32, dtype), QuantFormat("int2", dim, 32, dtype)),
    )
    backend = make_backend(GPUTarget("cuda", arch, 32))
    keys: dict[str, set] = {}
    for n in sizes:
        tiers = PagedTiers(lay, 2, 2, None)
        for t in range(2):
            tiers.append(t, torch.zeros(2, 2, n + t, lay[t].nbytes, dtype=torch.uint8), torch.ones(2, 2, n + t).bool())
        ring = torch.zeros(2, 2, 24, dim, dtype=dtype)
        win = DenseSlots(ring, ring.clone(), torch.arange(24), torch.zeros(2, 2, 24))
        parts = [win] + [PagedSlots(tiers.pool.data, tiers.tables[t], tiers.tpp[t], lay[t]) for t in range(2)]
        new = torch.zeros(2, 2, 1, dim, dtype=dtype)
        write = PendingWrite(new, new, n % 24, 40 + n)
        with captured_launches() as got:
            paged_attention(torch.zeros(2, 8, 1, dim, dtype=dtype), parts, 40 + n, torch.zeros(2, dtype=torch.long),
                            0.1, "max", return_delta=False, window_write=write)  # fmt: skip
        for fn, args, kwargs in got:
            sig, consts, attrs, options = _specialized(fn, backend, args, kwargs)
            key = (repr(sorted(sig.items())), repr(sorted(consts.items())), repr(sorted(attrs.items())))
            keys.setdefault(fn.__name__, set()).add(key)
    return {name: len(k) for name, k in keys.items()}


def main(report: Callable[[str], None] = print) -> int:
    done = compile_calls(representative_calls())
    for r in done:
        loads = " ".join(f"{k}:{v}" for k, v in r["global_loads"].items())
        size = f"shared {r['shared_bytes']:>6} B  cubin {r['cubin_bytes']:>7} B"
        report(f"{r['kernel']:<22} {size}  loads {loads}  {r['constexprs']}")
    counts = decode_instances()
    report("decode-step instances over 7 storage states: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    report(f"{len(done)} kernel configurations compiled for sm_90")
    return 0 if all(v == 1 for v in counts.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
