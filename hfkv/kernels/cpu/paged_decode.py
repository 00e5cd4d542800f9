"""Paged decode attention on CPU tensors: :func:`~hfkv.kernels.decode_attention.paged_attention`'s contract,
run by the C++ loop of ``paged_decode.cpp`` (why a loop and not tensor ops: that file's header).

The torch twin is :func:`hfkv.kernels.reference.paged_attention_reference`; the tests compare the two
on the layouts the cache writes. Decode steps (a few query rows per KV head) and prefill chunks (in tiles of
``TILE_ROWS`` rows) both go through it.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

from hfkv.kernels.cpu.build import library
from hfkv.kernels.parts import DenseSlots, Part, plan_key
from hfkv.kernels.reference import REDUCTIONS, check_call
from hfkv.quant.formats import INT_BITS, QuantFormat

__all__ = ["CpuPlan", "paged_attention_cpu", "paged_attention_traced", "plan_cpu"]

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FAMILIES = {"model": 0, "fp8": 2}


class _Field(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in ("family", "bits", "group", "dtype", "offset")]


class _Part(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("k", "v", "pos", "score", "pool", "table")),
        ("page_bytes", ctypes.c_int64),
        *(
            (name, ctypes.c_int32)
            for name in (
                "paged",
                "slots",
                "dense_dtype",
                "table_w",
                "tpp",
                "record",
                "tag_offset",
                "score_offset",
                "add_scores",
            )
        ),  # fmt: skip
        ("key", _Field),
        ("value", _Field),
    ]


# Query rows per KV head one pass of the kernel takes: a prefill chunk's queries go through in tiles of this many
# rows (each tile reads every slot once for all its rows; its logits, 4 bytes a row and slot, stay near the
# core). From 32 to 256 rows a 16k-token chunked prefill's attention took the same time (8k, 1 thread).
TILE_ROWS = 64

_SCRATCH = threading.local()
_SCRATCH_KEEP = 1 << 24  # 64 MiB


def _scratch(numel: int) -> torch.Tensor:
    """``numel`` fp32 of this thread's logits scratch, grown geometrically and reused across calls.

    A fresh buffer of a decode step's logits (hundreds of KB per layer) comes from the OS as new pages, and
    zeroing them on first touch costs as much as a few thousand slots of attention; with several kernel
    threads the page faults also serialise on the process's memory map. Beyond ``_SCRATCH_KEEP`` floats (a
    long chunk's rows) the buffer is not kept.
    """
    if numel > _SCRATCH_KEEP:
        return torch.empty(numel, dtype=torch.float32)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < numel:
        grown = max(numel, 2 * (buf.numel() if buf is not None else 0))
        buf = torch.empty(min(grown, _SCRATCH_KEEP), dtype=torch.float32)
        _SCRATCH.buf = buf
    return buf[:numel]


@cache
def _kernel():
    """The C entry point with its argument types, set once (ctypes setup is microseconds a step otherwise)."""
    fn = library().hfkv_paged_decode
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [
        ptr, i32, i32, i32, i32, i32, i64, ptr, i32, ctypes.POINTER(_Part), i32, ptr, ptr, ptr, i32, i32,
        ctypes.c_float, i32,
    ]  # fmt: skip
    fn.restype = ctypes.c_int
    if library().hfkv_part_size() != ctypes.sizeof(_Part):
        raise RuntimeError("hfkv CPU kernel: the C and ctypes part layouts differ (a stale build?)")
    return fn


def _dtype_code(dtype: torch.dtype) -> int:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"hfkv CPU kernel: model dtype {dtype} is not supported; allowed: {list(_DTYPES)}") from None


def _field(fmt: QuantFormat, offset: int) -> _Field:
    return _Field(*_field_ints(fmt, offset))


def _field_ints(fmt: QuantFormat, offset: int) -> tuple[int, int, int, int, int]:
    """A field's (family, bits, group, dtype, offset): plain ints, which Dynamo traces (a ctypes structure not)."""
    if fmt.name in INT_BITS:
        return 1, INT_BITS[fmt.name], fmt.group_size, 0, offset
    dtype = _dtype_code(fmt.model_dtype) if fmt.name == "model" else 0
    return _FAMILIES[fmt.name], fmt.bits, fmt.head_dim, dtype, offset


def _describe(part: Part, add_scores: bool, keep: list[torch.Tensor]) -> _Part:
    """The C description of a part; tensors it points into are appended to ``keep`` (alive for the call)."""
    if isinstance(part, DenseSlots):
        k, v, pos = part.k.contiguous(), part.v.contiguous(), part.pos.to(torch.int64).contiguous()
        score = part.score
        if score is not None and not (score.is_contiguous() and score.dtype == torch.float32):
            raise ValueError("paged_attention_cpu: a dense part's score must be a contiguous fp32 tensor")
        if k.dtype != v.dtype:
            raise ValueError(f"paged_attention_cpu: dense keys are {k.dtype} but values {v.dtype}")
        keep += [k, v, pos]
        return _Part(
            k=k.data_ptr(),
            v=v.data_ptr(),
            pos=pos.data_ptr(),
            score=score.data_ptr() if score is not None else None,
            paged=0,
            slots=part.slots,
            dense_dtype=_dtype_code(k.dtype),
            add_scores=int(add_scores and score is not None),
        )
    if not (part.pool.is_contiguous() and part.pool.dtype == torch.uint8):
        raise ValueError("paged_attention_cpu: a tier's pool must be a contiguous uint8 tensor")
    lay = part.layout
    table = part.table.to(torch.int32).contiguous()
    keep.append(table)
    return _Part(
        pool=part.pool.data_ptr(),
        table=table.data_ptr(),
        page_bytes=part.pool.shape[1],
        paged=1,
        slots=part.slots,
        table_w=table.shape[-1],
        tpp=part.tpp,
        record=lay.stride,
        tag_offset=lay.tag_region(part.tpp),
        score_offset=lay.score_region(part.tpp),
        add_scores=int(add_scores),
        key=_field(lay.key, 0),
        value=_field(lay.value, lay.key.nbytes),
    )


@dataclass
class CpuPlan:
    """The C descriptions of a layer's parts, kept while its storage's tensors stay (``plan_key``): a
    decode step then calls the kernel without describing its parts again (tens of microseconds of ctypes
    per part). Only parts described without a copy are planned: a copy would go stale."""

    key: tuple
    described: ctypes.Array
    keep: list[torch.Tensor]
    s_total: int
    heads: int  # KV heads and GQA group of the query it was made for (check_call's answer)
    g: int


def plan_cpu(query: torch.Tensor, parts: Sequence[Part], add_scores: bool = True) -> CpuPlan | None:
    """A :class:`CpuPlan` for ``parts``, or None where describing them needs a copy (then describe per call)."""
    heads, g = check_call(query, parts, torch.zeros(query.shape[0], dtype=torch.int64), "max")
    keep: list[torch.Tensor] = []
    described = (_Part * len(parts))(*(_describe(p, add_scores, keep) for p in parts))
    held = {id(t) for p in parts for t in ((p.k, p.v, p.pos) if isinstance(p, DenseSlots) else (p.table,))}
    if any(id(t) not in held for t in keep):
        return None
    keep += [t for p in parts for t in ((p.score,) if isinstance(p, DenseSlots) else (p.pool,)) if t is not None]
    return CpuPlan(plan_key(query, parts, False), described, keep, sum(p.slots for p in parts), heads, g)


def paged_attention_cpu(
    query: torch.Tensor,
    parts: Sequence[Part],
    q_start: int,
    pad_end: torch.Tensor,
    scaling: float,
    reduction: str = "max",
    add_scores: bool = True,
    return_delta: bool = True,
    threads: int | None = None,
    min_split: int = 512,
    plan: CpuPlan | None = None,
    checked: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``query [B, Hq, q, D]`` (logical positions ``q_start ..``) over every part's slots.

    Same arguments and results as :func:`hfkv.kernels.decode_attention.paged_attention`: ``(out [B, q,
    Hq, D]`` in the query dtype, ``delta [B, H, sum slots]`` or None), with each slot's GQA-reduced
    probability added to its score sum in place when ``add_scores``. CPU tensors only.

    ``threads`` (default: ``torch.get_num_threads()`` now, so a later ``torch.set_num_threads`` is honoured)
    threads share the (row, KV head) pairs; where those are fewer than twice the threads, each pair's slots
    are cut into ranges of at least ``min_split`` slots (split-K) so every thread has work.

    ``plan`` (:func:`plan_cpu` of the same parts, made with the same ``add_scores``) skips describing them;
    with it, ``checked=False`` also skips validating the arguments, which the plan's were (the cache's decode
    step, whose parts are its own storage: a few microseconds of its host time per layer).
    """
    if checked or plan is None:
        heads, g = check_call(query, parts, pad_end, reduction)
        if query.device.type != "cpu":
            raise ValueError(f"paged_attention_cpu: tensors must be on the CPU, got query on {query.device}")
    else:
        heads, g = plan.heads, plan.g
    keep: list[torch.Tensor] = []
    if plan is not None:
        described, s_total = plan.described, plan.s_total
    else:
        described = (_Part * len(parts))(*(_describe(p, add_scores, keep) for p in parts))
        s_total = sum(p.slots for p in parts)
    return _run(query, heads, g, described, s_total, q_start, pad_end, scaling, reduction, return_delta, threads,
                min_split)  # fmt: skip


def _run(query, heads: int, g: int, described, s_total: int, q_start: int, pad_end: torch.Tensor, scaling: float,
         reduction: str, return_delta: bool, threads: int | None = None, min_split: int = 512):  # fmt: skip
    """The kernel call on described parts: ``(out [B, q, Hq, D], delta or None)``."""
    bsz, hq, qlen, dim = query.shape
    # Rows of one KV head ordered (group member, query), as the torch path orders them; scaled by the kernel.
    qf = query.reshape(bsz, heads, g * qlen, dim).float().contiguous()
    pad = pad_end.to(torch.int64).contiguous()
    out = torch.empty(bsz, heads, g * qlen, dim, dtype=torch.float32)  # zeroed by the kernel
    delta = torch.empty(bsz, heads, s_total, dtype=torch.float32) if return_delta else None
    threads = torch.get_num_threads() if threads is None else threads
    if threads < 1 or min_split < 1:
        raise ValueError(f"paged_attention_cpu: threads={threads} and min_split={min_split} must be >= 1")
    # A chunk's queries in tiles of TILE_ROWS rows per KV head; per (row, head), a tile's logits padded to whole
    # vectors.
    tile = max(1, TILE_ROWS // g) if g * qlen > TILE_ROWS else qlen
    logits = _scratch(bsz * heads * g * tile * (-(-s_total // 16) * 16))
    status = _kernel()(
        qf.data_ptr(), bsz, heads, g, qlen, dim, q_start, pad.data_ptr(), len(described), described,
        REDUCTIONS[reduction], out.data_ptr(), delta.data_ptr() if delta is not None else None, logits.data_ptr(),
        threads, min_split, scaling, tile,
    )  # fmt: skip
    if status != 0:
        raise ValueError(
            f"paged_attention_cpu: head_dim={dim} is beyond what the CPU kernel reads (head_dim <= 512); "
            "use TriStateConfig.backend='torch'"
        )
    return out.view(bsz, hq, qlen, dim).transpose(1, 2).to(query.dtype), delta


# -- the kernel as a torch operator, for steps under torch.compile (hfkv.compiled)
#
# Dynamo cannot trace ctypes, data pointers or the plan kept by identity. Registered as an operator, the kernel is
# one opaque node of the compiled graph: its arguments are tensors and the constants of each part's record layout,
# and the tensors it adds scores to (the ring's score sums, the tiers' shared pool) are declared as mutated, so the
# graph orders reads after the kernel's writes. Each call describes its parts again (what a kept plan saves eagerly).

_LAYOUT_INTS = 17  # per part: paged, tpp, record, tag_offset, score_offset, add_scores, scored index, key, value


def _layout_ints(part: Part, add_scores: bool, scored_index: int) -> list[int]:
    """The constants of a part's description that no tensor carries (its record layout), as plain ints."""
    if isinstance(part, DenseSlots):
        return [0, 0, 0, 0, 0, int(add_scores and part.score is not None), scored_index] + [0] * 10
    lay = part.layout
    return [
        1, part.tpp, lay.stride, lay.tag_region(part.tpp), lay.score_region(part.tpp), int(add_scores), scored_index,
        *_field_ints(lay.key, 0), *_field_ints(lay.value, lay.key.nbytes),
    ]  # fmt: skip


@torch.library.custom_op("hfkv::paged_attention_cpu", mutates_args=("scored",), device_types="cpu")
def _paged_attention_op(
    query: torch.Tensor,
    reads: list[torch.Tensor],
    scored: list[torch.Tensor],
    layouts: list[int],
    q_start: int,
    pad_end: torch.Tensor,
    scaling: float,
    reduction: str,
) -> torch.Tensor:
    described, at = [], 0
    for i in range(len(layouts) // _LAYOUT_INTS):
        paged, tpp, record, tag, score, add, sidx, *fields = layouts[i * _LAYOUT_INTS : (i + 1) * _LAYOUT_INTS]
        if not paged:
            k, v, pos = reads[at : at + 3]
            at += 3
            s = scored[sidx] if sidx >= 0 else None
            described.append(
                _Part(k=k.data_ptr(), v=v.data_ptr(), pos=pos.data_ptr(), score=s.data_ptr() if s is not None else None,
                      paged=0, slots=k.shape[2], dense_dtype=_dtype_code(k.dtype), add_scores=add)
            )  # fmt: skip
            continue
        table, pool = reads[at], scored[sidx]
        at += 1
        described.append(
            _Part(pool=pool.data_ptr(), table=table.data_ptr(), page_bytes=pool.shape[1], paged=1,
                  slots=table.shape[-1] * tpp, table_w=table.shape[-1], tpp=tpp, record=record, tag_offset=tag,
                  score_offset=score, add_scores=add, key=_Field(*fields[:5]),
                  value=_Field(*fields[5:]))
        )  # fmt: skip
    heads = reads[0].shape[1]  # a ring's keys or a tier's table: [B, H, ..]
    out, _ = _run(
        query,
        heads,
        query.shape[1] // heads,
        (_Part * len(described))(*described),
        sum(p.slots for p in described),
        q_start,
        pad_end,
        scaling,
        reduction,
        return_delta=False,
    )
    return out


@_paged_attention_op.register_fake
def _(query, reads, scored, layouts, q_start, pad_end, scaling, reduction):
    bsz, hq, qlen, dim = query.shape
    return query.new_empty(bsz, hq, qlen, dim).transpose(1, 2)


def paged_attention_traced(
    query: torch.Tensor, parts: Sequence[Part], q_start: int, pad_end: torch.Tensor, scaling: float, reduction: str
) -> torch.Tensor:
    """:func:`paged_attention_cpu` (scores added, no delta) through the ``hfkv::paged_attention_cpu`` operator,
    which Dynamo puts in a compiled graph as one call. Arguments as for :func:`paged_attention_cpu`."""
    reads: list[torch.Tensor] = []
    scored: list[torch.Tensor] = []
    layouts: list[int] = []

    def scored_index(t: torch.Tensor | None) -> int:
        if t is None:
            return -1
        for i, s in enumerate(scored):
            if s is t:  # the tiers share one pool: passed once (mutated arguments must not alias)
                return i
        scored.append(t)
        return len(scored) - 1

    for p in parts:
        if isinstance(p, DenseSlots):
            if p.score is not None and not (p.score.is_contiguous() and p.score.dtype == torch.float32):
                raise ValueError("paged_attention_traced: a dense part's score must be a contiguous fp32 tensor")
            reads += [p.k.contiguous(), p.v.contiguous(), p.pos.to(torch.int64).contiguous()]
            layouts += _layout_ints(p, True, scored_index(p.score))
        else:
            reads.append(p.table.to(torch.int32).contiguous())
            layouts += _layout_ints(p, True, scored_index(p.pool))
    return _paged_attention_op(query, reads, scored, layouts, q_start, pad_end, scaling, reduction)
