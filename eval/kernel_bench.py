"""GPU benchmark of hfkv's paged decode-attention kernel, and one end-to-end decode figure.

Decode attention is bandwidth-bound, so the question is not "how many ms" but "how close to the
memory system does the kernel get for the bytes it has to read". Both sides of that ratio are
measured here on the same device:

* **Copy bandwidth**: ``dst.copy_(src)`` of a large buffer (2 GiB by default), timed with CUDA
  events; bandwidth = 2 * bytes / time, counting every byte read and every byte written (the
  convention of METHOD-style "device-to-device copy" figures).
* **Kernel**: ``paged_attention(..., add_scores=True)`` for one new token (q = 1) of one layer of
  Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head_dim 128, bf16) over a
  ``PagedTiers`` filled on the GPU for a storage kind:

  - ``full``: every token in the ``original`` tier (model-dtype K and V records);
  - ``quant``: every token in the ``quantized`` tier (the hfkv preset's K int4 / V int2, group 32);
  - ``hfkv``: a memory-budget mix: a full window ring of ``window + interval`` = 16 + 8 tokens in
    bf16 (the hfkv preset's ring just before a policy run), 1/8 of the other tokens exact (every
    8th position) and the rest K4V2.

  The bytes it must read are computed from the layouts, not from timings (``kernel_bytes``): the
  query, the window ring's K/V and positions, every live record's K/V bytes and tag, and the page
  tables. What the kernel moves beyond that (reads of the empty slots of each head's last page,
  the logits it writes and reads back, the flash-decoding partials, the score read-modify-writes
  and the output) is counted separately as overhead, so ``read_fraction`` answers "how
  close to the copy bandwidth for the bytes it needs" and ``traffic_fraction`` "for all it moves".
* **SDPA**: ``scaled_dot_product_attention`` of the same query over a dense bf16 K/V of the same
  logical length under the flash backend (``enable_gqa``; expanded to 32 heads only if flash
  refuses GQA), the decode step a DynamicCache pays.

Every timing: warm-up, then (on CUDA) a CUDA-graph replay per repeat so the Python launch cost of
the kernel's small launches stays out, with L2 flushed before each repeat so small cases are not
timed from cache; the median is reported with the 20th / 80th percentiles. Cases whose memory
(computed before allocating) exceeds the free GPU memory are recorded as skipped with the reason.

End to end: a random-weight model of Llama-3.1-8B's shape in bf16 (built from a config, no
download), a 32k-token prompt x batch 8 prefilled in chunks, then decode steps timed for a
DynamicCache and for ``TriStateCache(model, "hfkv", budget=..., backend="triton")``: step time,
peak memory above the weights, KV bytes held, compression and speed-up.

Targets (reported, never asserted): kernel >= 80% of the copy bandwidth for the bytes it reads at
>= 16k tokens x batch >= 8; faster than SDPA in proportion to the bytes saved; end to end at 32k x
batch 8 faster than DynamicCache by at least half the compression ratio.

    python eval/kernel_bench.py                       # the full sweep + end to end (needs a CUDA GPU)
    python eval/kernel_bench.py --skip-e2e --contexts 4096,32768 --batches 1,8 --kinds quant,hfkv

Writes ``<out>/kernel_bench_<device-slug>.json`` and ``.png`` (docs/kernels.md), ``--out`` by default
``hfkv-out/eval`` under the working directory (``--out eval/results/gpu`` for the committed results).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hfkv.atomic import write_atomic  # noqa: E402
from hfkv.evaluation.results import json_safe, parse_list, provenance  # noqa: E402
from hfkv.evaluation.shapes import get_shape  # noqa: E402
from hfkv.quant.formats import QuantFormat  # noqa: E402
from hfkv.quant.record import RecordLayout  # noqa: E402
from hfkv.storage.paged import auto_page_bytes  # noqa: E402

KINDS = ("full", "quant", "hfkv")
DEFAULT_CONTEXTS = "4096,8192,16384,32768,65536,131072"
DEFAULT_BATCHES = "1,2,4,8,16,32"
# a run's default output folder, under the working directory (the committed one: --out eval/results/gpu)
DEFAULT_OUT = "hfkv-out/eval"
HFKV_EXACT_EVERY = 8  # hfkv kind: every 8th paged token exact, the rest K4V2
FLUSH_BYTES = 256 << 20  # larger than any GPU's L2 (H100: 50 MB, H200: 60 MB)
MEMORY_HEADROOM = 0.9  # share of the free GPU memory a case may plan to use
BUILD_ROWS = 1 << 18  # (row, head, token) records encoded per append while filling the storage
GIB = 1 << 30
CHECK_TOLERANCE = 2e-2  # ||out - ref|| / ||ref|| for bf16 operands (METHOD: 1e-3 .. 1e-2)
CHECK_MAX_RECORDS = 1 << 20  # (row, head, token) records up to which a case is checked against the torch twin
TARGET_FRACTION = 0.8
TARGET_MIN_CONTEXT, TARGET_MIN_BATCH = 16384, 8


# ------------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class AttnShape:
    """One attention layer: query heads, KV heads, head_dim, model dtype."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def esize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def like(cls, name: str, dtype: torch.dtype = torch.bfloat16) -> AttnShape:
        s = get_shape(name)
        return cls(s.heads, s.kv_heads, s.dim, dtype)


def tier_layouts(shape: AttnShape) -> tuple[RecordLayout, RecordLayout]:
    """The ``original`` and ``quantized`` record layouts of the hfkv preset at this shape.

    Taken from the preset (not hard-coded) so the benchmark follows the cache's defaults if they
    change; the ``quant`` preset uses the same K4V2 tier by default.
    """
    from hfkv.config import TriStateConfig

    cfg = TriStateConfig.from_preset("hfkv")
    out = []
    for name in ("original", "quantized"):
        tier, group = getattr(cfg, name), cfg.group_for(name, shape.head_dim)
        out.append(
            RecordLayout(
                QuantFormat(tier.key, shape.head_dim, group, shape.dtype),
                QuantFormat(tier.value, shape.head_dim, group, shape.dtype),
            )
        )
    return out[0], out[1]


def hfkv_window_slots() -> int:
    """Ring slots of the hfkv preset: ``window + interval`` (the ring just before a policy run)."""
    from hfkv.config import TriStateConfig

    cfg = TriStateConfig.from_preset("hfkv")
    return cfg.window + cfg.interval


# -------------------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class Plan:
    """What one kernel case stores: per (row, KV head) the same tokens, so every head is equally long."""

    kind: str
    context: int
    batch: int
    shape: AttnShape
    layouts: tuple[RecordLayout, RecordLayout]
    page_bytes: int
    window: int  # ring slots, all filled
    tier_tokens: tuple[int, int]  # tokens per (row, head) in the original and quantized tiers

    @property
    def tpp(self) -> tuple[int, ...]:
        return tuple(self.page_bytes // lay.nbytes for lay in self.layouts)

    def pages_per_head(self) -> tuple[int, ...]:
        return tuple(-(-n // tpp) for n, tpp in zip(self.tier_tokens, self.tpp, strict=True))

    def total_pages(self) -> int:
        """Pages the pool must hand out (the null page is reserved on top by the pool)."""
        return self.batch * self.shape.kv_heads * sum(self.pages_per_head())

    def slots(self) -> tuple[int, ...]:
        """Slots the kernel walks per part and head: the ring, then each tier's whole pages."""
        return (self.window, *(p * t for p, t in zip(self.pages_per_head(), self.tpp, strict=True)))

    def positions(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logical positions ``(window, original, quantized)`` shared by every row and head."""
        t, w = self.context, self.window
        window = torch.arange(t - w, t)
        paged = torch.arange(t - w)
        if self.kind == "full":
            return window, paged, paged[:0]
        if self.kind == "quant":
            return window, paged[:0], paged
        exact = paged % HFKV_EXACT_EVERY == 0
        return window, paged[exact], paged[~exact]

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "context": self.context,
            "batch": self.batch,
            "heads": self.shape.heads,
            "kv_heads": self.shape.kv_heads,
            "head_dim": self.shape.head_dim,
            "dtype": str(self.shape.dtype).replace("torch.", ""),
            "window_slots": self.window,
            "tokens_original": self.tier_tokens[0],
            "tokens_quantized": self.tier_tokens[1],
            "page_bytes": self.page_bytes,
            "record_bytes": [lay.nbytes for lay in self.layouts],
            "formats": [f"{lay.key.name}/{lay.value.name}" for lay in self.layouts],
        }


def make_plan(kind: str, context: int, batch: int, shape: AttnShape) -> Plan:
    """The storage of ``context`` tokens per (row, head) for a storage kind (module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; allowed: {KINDS}")
    layouts = tier_layouts(shape)
    window = hfkv_window_slots() if kind == "hfkv" else 0
    if context <= window:
        raise ValueError(f"context={context} must exceed the {window}-slot window of kind {kind!r}")
    paged = context - window
    if kind == "full":
        tokens = (paged, 0)
    elif kind == "quant":
        tokens = (0, paged)
    else:
        exact = -(-paged // HFKV_EXACT_EVERY)
        tokens = (exact, paged - exact)
    # Both tiers share the pool as in a cache layer, so the page size is the one the cache would pick.
    page = auto_page_bytes([lay.nbytes for lay in layouts])
    return Plan(kind, context, batch, shape, layouts, page, window, tokens)


# --------------------------------------------------------------------------------- bytes accounting
def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def kernel_blocks(shape: AttnShape, qlen: int = 1) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_D)`` of the decode kernel: rows of one program (GQA group x queries) and columns."""
    return max(16, _next_pow2(shape.group) * _next_pow2(qlen)), max(16, _next_pow2(shape.head_dim))


def kernel_splits(plan: Plan) -> list[int]:
    """Programs per (row, head) of every part, as ``paged_attention`` chooses them (flash-decoding splits)."""
    from hfkv.kernels.decode_attention import (
        BLOCK_N,
        SPLIT_PROGRAMS,
        _split_slots,
        default_num_warps,
        held_integers,
        programs_target,
    )

    gpu = torch.cuda.is_available()
    integer = held_integers(zip(plan.tier_tokens, plan.layouts, strict=True))
    target = programs_target(torch.device("cuda"), default_num_warps(integer), None) if gpu else SPLIT_PROGRAMS
    out = []
    for n in plan.slots():
        if n == 0:
            out.append(0)
            continue
        sp = _split_slots(n, plan.batch * plan.shape.kv_heads, BLOCK_N, None, False, target)
        out.append(-(-n // sp))
    return out


def kernel_bytes(plan: Plan, qlen: int = 1) -> dict[str, int]:
    """Bytes one ``paged_attention`` call must read, and what it moves beyond that, from the layouts.

    ``read_*`` is the floor (each needed byte once): without it no kernel can attend. ``overhead_*``
    is what this kernel design adds (whole last pages, logits written then re-read by the score
    pass, flash-decoding partials, the in-place score sums, output; the cache asks for no deltas); ``records_held`` is
    what the live records occupy in the pool (their K/V, tag, score and alignment padding).
    """
    s, bh = plan.shape, plan.batch * plan.shape.kv_heads
    esz, d = s.esize, s.head_dim
    live = [bh * n for n in plan.tier_tokens]
    walked = [bh * n for n in plan.slots()[1:]]
    pages = [bh * p for p in plan.pages_per_head()]
    lays = plan.layouts
    out = {
        "read_query": plan.batch * s.heads * qlen * d * esz,
        "read_window_kv": 2 * bh * plan.window * d * esz,
        "read_window_pos": plan.window * 8,  # int64 positions, shared by rows and heads
        "read_records_kv": sum(n * lay.kv_bytes for n, lay in zip(live, lays, strict=True)),
        "read_records_tags": 4 * sum(live),
        "read_page_tables": 4 * sum(pages),
    }
    out["read_total"] = sum(v for k, v in out.items() if k.startswith("read_"))
    block_r, block_d = kernel_blocks(s, qlen)
    n_slots = sum(plan.slots())
    splits = sum(kernel_splits(plan))
    rows = s.group * qlen  # valid logit rows per (row, head)
    over = {
        # masked loads of a head's last page still fetch the empty slots' K/V and tags
        "overhead_page_tails": sum((w - n) * (lay.kv_bytes + 4) for w, n, lay in zip(walked, live, lays, strict=True)),
        "overhead_logits": 2 * 4 * bh * rows * n_slots,  # written by the partial pass, read by the score pass
        "overhead_partials": 2 * 4 * bh * splits * block_r * (2 + block_d) + 2 * 4 * 2 * bh * block_r,
        # the score pass read-modify-writes the score field of every slot its pages hold, and the ring's
        "overhead_scores": 8 * sum(walked) + 8 * bh * plan.window,
        "overhead_output": plan.batch * qlen * s.heads * d * esz,
    }
    out |= over
    out["overhead_total"] = sum(over.values())
    out["traffic_total"] = out["read_total"] + out["overhead_total"]
    out["records_held"] = sum(n * lay.nbytes for n, lay in zip(live, lays, strict=True))
    return out


def sdpa_bytes(context: int, batch: int, shape: AttnShape, expanded: bool = False, qlen: int = 1) -> dict[str, int]:
    """Bytes flash SDPA must read and write for one decode step over a dense cache of ``context`` tokens."""
    kv_heads = shape.heads if expanded else shape.kv_heads
    esz, d = shape.esize, shape.head_dim
    read = batch * shape.heads * qlen * d * esz + 2 * batch * kv_heads * context * d * esz
    return {"read_total": read, "write_total": batch * shape.heads * qlen * d * esz}


# ------------------------------------------------------------------------------------------- memory
def kernel_memory(plan: Plan) -> int:
    """GPU bytes a kernel case allocates at its peak: storage, scratch (eager + graph pool), build temporaries."""
    s, bh = plan.shape, plan.batch * plan.shape.kv_heads
    esz, d = s.esize, s.head_dim
    pool = (plan.total_pages() + 1) * plan.page_bytes + 4 * (plan.total_pages() + 1)  # + free stack
    tables = 4 * bh * sum(plan.pages_per_head())
    window = bh * plan.window * (2 * d * esz + 4) + 8 * plan.window
    query = plan.batch * s.heads * d * esz
    block_r, block_d = kernel_blocks(s)
    n_slots, splits = sum(plan.slots()), sum(kernel_splits(plan))
    # logits of the valid query rows, flash-decoding partials, the combined max/sum
    scratch = 4 * bh * (s.group * n_slots + splits * block_r * (2 + block_d) + 2 * block_r) + query
    rows = min(BUILD_ROWS, bh * max(plan.tier_tokens))
    big = max(lay.nbytes for lay in plan.layouts)
    # k, v in the model dtype, their fp32 working copies in encode, the records and their gathered copy
    build = rows * (2 * d * esz + 8 * d * 4 + 3 * big + 32)
    return pool + tables + window + query + 2 * scratch + build + FLUSH_BYTES


def sdpa_memory(context: int, batch: int, shape: AttnShape, expanded: bool = False) -> int:
    kv = 2 * batch * shape.kv_heads * context * shape.head_dim * shape.esize
    if expanded:  # the GQA-expanded copy lives beside the original
        kv += 2 * batch * shape.heads * context * shape.head_dim * shape.esize
    q = batch * shape.heads * shape.head_dim * shape.esize
    return kv + 4 * q + FLUSH_BYTES


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass
class Case:
    """One (kind, context, batch) kernel case, and whether it (and the SDPA beside it) fits."""

    plan: Plan
    need: int
    skip: str | None = None
    sdpa_need: int = 0
    sdpa_skip: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def enumerate_cases(
    kinds: Sequence[str], contexts: Sequence[int], batches: Sequence[int], shape: AttnShape, free_bytes: int
) -> list[Case]:
    """Every case in run order (context, batch, kind), each marked skipped when it would not fit.

    The need is computed before anything is allocated, so an oversized case costs a line in the
    results rather than an out-of-memory error half-way through a sweep.
    """
    limit = int(free_bytes * MEMORY_HEADROOM)
    out = []
    for context in contexts:
        for batch in batches:
            sneed = sdpa_memory(context, batch, shape)
            sskip = None
            if sneed > limit:
                sskip = f"needs {_gib(sneed)} > {_gib(limit)} ({MEMORY_HEADROOM:.0%} of {_gib(free_bytes)} free)"
            for kind in kinds:
                plan = make_plan(kind, context, batch, shape)
                need = kernel_memory(plan)
                skip = None
                if need > limit:
                    skip = f"needs {_gib(need)} > {_gib(limit)} ({MEMORY_HEADROOM:.0%} of {_gib(free_bytes)} free)"
                out.append(Case(plan, need, skip, sneed, sskip))
    return out


# ------------------------------------------------------------------------------------------- timing
def _percentile(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def time_fn(
    fn: Callable[[], Any],
    device: torch.device | str,
    repeats: int = 50,
    warmup: int = 5,
    graph: bool = True,
    flush_bytes: int = FLUSH_BYTES,
) -> dict[str, Any]:
    """Seconds of ``fn`` per call: median and 20th / 80th percentiles over ``repeats`` timed calls.

    On CUDA each repeat is a CUDA-graph replay between two events (launch gaps of the many small
    launches are not the kernel's), preceded by a write of ``flush_bytes`` outside the events so a
    case smaller than L2 is read from memory as in a real step. Where capture fails it falls back
    to eager launches and says so. On a CPU (Triton's interpreter) it is wall-clock time.
    """
    from hfkv.evaluation.bench import Clock

    device = torch.device(device)
    cuda = device.type == "cuda"
    clock = Clock(device)
    for _ in range(max(1, warmup)):
        fn()
    run, mode = fn, "graph" if cuda and graph else ("eager" if cuda else "wall")
    if cuda and graph:
        try:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            g.replay()
            torch.cuda.synchronize()
            run = g.replay
        except Exception as exc:  # noqa: BLE001 - any capture failure leaves eager timing usable
            mode = f"eager (graph capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
            torch.cuda.synchronize()
    flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device) if cuda and flush_bytes else None
    times: list[float] = []
    for _ in range(repeats):
        if flush is not None:
            flush.zero_()
        t0 = clock.start()
        run()
        clock.stop(t0, times)
    clock.resolve()
    return {
        "ms_median": 1e3 * statistics.median(times),
        "ms_p20": 1e3 * _percentile(times, 0.2),
        "ms_p80": 1e3 * _percentile(times, 0.8),
        "ms_min": 1e3 * min(times),
        "repeats": repeats,
        "mode": mode,
    }


def measure_copy_bandwidth(nbytes: int = 2 * GIB, repeats: int = 20) -> dict[str, Any]:
    """Device-to-device copy bandwidth in GB/s (1e9 bytes), counting bytes read plus bytes written."""
    free = torch.cuda.mem_get_info()[0]
    nbytes = int(min(nbytes, free * 0.4) // 4096 * 4096)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")  # never time zeros
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), "cuda", repeats=repeats, warmup=3, graph=False, flush_bytes=0)
    assert torch.equal(dst[:4096], src[:4096]) and torch.equal(dst[-4096:], src[-4096:])
    gbps = 2 * nbytes / (t["ms_median"] / 1e3) / 1e9
    return {
        "bytes": nbytes,
        "gbps": gbps,
        "gbps_p20_p80": [2 * nbytes / (t["ms_p80"] / 1e3) / 1e9, 2 * nbytes / (t["ms_p20"] / 1e3) / 1e9],
        "timing": t,
        "convention": "2 * bytes / time: every byte read and every byte written counts; GB = 1e9 bytes",
    }


# ------------------------------------------------------------------------------------------ storage
@dataclass
class Storage:
    tiers: Any
    window: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    query: torch.Tensor

    def parts(self, plan: Plan) -> list:
        from hfkv.kernels.decode_attention import DenseSlots, PagedSlots

        parts = [DenseSlots(*self.window)] if self.window is not None else []
        t = self.tiers
        parts += [PagedSlots(t.pool.data, t.tables[i], t.tpp[i], lay) for i, lay in enumerate(plan.layouts)]
        return parts


def build_storage(plan: Plan, device: torch.device | str, seed: int = 0) -> Storage:
    """The plan's tokens in a real ``PagedTiers`` on ``device``: random K/V (never zeros), encoded in chunks.

    The pool is sized up front (exactly the pages the plan needs), so filling never grows and
    copies it: the peak is the storage, not twice the storage.
    """
    from hfkv.storage import PagedTiers

    s, device = plan.shape, torch.device(device)
    bsz, heads, d = plan.batch, s.kv_heads, s.head_dim
    g = torch.Generator(device=device).manual_seed(seed)
    tiers = PagedTiers(plan.layouts, bsz, heads, plan.page_bytes, device, initial_pages=plan.total_pages(), growth=0.0)
    win_pos, *tier_pos = plan.positions()
    step = max(1, BUILD_ROWS // (bsz * heads))
    for t, (lay, pos) in enumerate(zip(plan.layouts, tier_pos, strict=True)):
        for start in range(0, pos.numel(), step):
            p = pos[start : start + step].to(device)
            n = p.numel()
            k = torch.randn(bsz, heads, n, d, generator=g, device=device, dtype=s.dtype)
            v = torch.randn(bsz, heads, n, d, generator=g, device=device, dtype=s.dtype)
            score = torch.rand(bsz, heads, n, generator=g, device=device)
            rec = lay.encode(k, v, p.expand(bsz, heads, n), score)
            tiers.append(t, rec, torch.ones(bsz, heads, n, dtype=torch.bool, device=device))
            del k, v, score, rec
    window = None
    if plan.window:
        w = plan.window
        k = torch.randn(bsz, heads, w, d, generator=g, device=device, dtype=s.dtype)
        v = torch.randn(bsz, heads, w, d, generator=g, device=device, dtype=s.dtype)
        window = (k, v, win_pos.to(device), torch.zeros(bsz, heads, w, dtype=torch.float32, device=device))
    query = torch.randn(bsz, s.heads, 1, d, generator=g, device=device, dtype=s.dtype)
    return Storage(tiers, window, query)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def bench_kernel_case(
    plan: Plan,
    device: torch.device | str,
    repeats: int,
    warmup: int = 5,
    graph: bool = True,
    check: bool = False,
    launch: dict[str, int] | None = None,
    storage: Storage | None = None,
) -> dict[str, Any]:
    """Build the plan's storage (or take ``storage``), (optionally) check the kernel against its torch twin,
    time one decode call; ``launch`` passes ``block_n`` / ``num_warps`` / ``num_stages`` to the kernel."""
    from hfkv.kernels.decode_attention import paged_attention, paged_attention_reference

    st = storage if storage is not None else build_storage(plan, device)
    parts = st.parts(plan)
    launch = launch or {}
    pad_end = torch.zeros(plan.batch, dtype=torch.int64, device=st.query.device)
    scaling = plan.shape.head_dim**-0.5
    result: dict[str, Any] = {}
    if check:  # the twin decodes every record to fp32: callers keep it to small cases (CHECK_MAX_RECORDS)
        try:
            out = paged_attention(st.query, parts, plan.context, pad_end, scaling, "max", add_scores=False, **launch)[0]
            ref = paged_attention_reference(st.query, parts, plan.context, pad_end, scaling, "max", False)[0]
            finite = bool(torch.isfinite(out).all())
            err = _rel_err(out, ref) if finite else float("nan")
            result["check"] = {"rel_err": err, "ok": finite and err < CHECK_TOLERANCE, "tolerance": CHECK_TOLERANCE}
            del out, ref
        except Exception as exc:  # noqa: BLE001 - a failed check is reported; the timing still runs
            result["check"] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}

    result["timing"] = time_fn(decode_call(st, parts, plan, launch), device, repeats, warmup, graph)
    return result


def decode_call(st: Storage, parts, plan: Plan, launch: dict[str, int] | None = None):
    """The decode call this benchmark times: one new token over the storage, scores added, no delta returned."""
    from hfkv.kernels.decode_attention import paged_attention

    pad_end = torch.zeros(plan.batch, dtype=torch.int64, device=st.query.device)
    scaling = plan.shape.head_dim**-0.5
    launch = launch or {}

    def call():
        return paged_attention(
            st.query, parts, plan.context, pad_end, scaling, "max", add_scores=True, return_delta=False, **launch
        )

    return call


def bench_sdpa(context: int, batch: int, shape: AttnShape, repeats: int, free_bytes: int) -> dict[str, Any]:
    """Flash SDPA of one new token over a dense bf16 K/V of ``context`` tokens (GQA, or expanded heads)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(1)
    d, dt = shape.head_dim, shape.dtype
    q = torch.randn(batch, shape.heads, 1, d, generator=g, device="cuda", dtype=dt)
    k = torch.randn(batch, shape.kv_heads, context, d, generator=g, device="cuda", dtype=dt)
    v = torch.randn(batch, shape.kv_heads, context, d, generator=g, device="cuda", dtype=dt)
    layout = "gqa"

    def gqa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    fn = gqa
    try:
        gqa()
        torch.cuda.synchronize()
    except RuntimeError as exc:
        need = sdpa_memory(context, batch, shape, expanded=True)
        if need > free_bytes * MEMORY_HEADROOM:
            first = str(exc).splitlines()[0][:160]
            return {"skipped": f"flash refused enable_gqa ({first}); expanded heads need {_gib(need)}"}
        ke = k.repeat_interleave(shape.group, dim=1)
        ve = v.repeat_interleave(shape.group, dim=1)
        layout = "expanded"

        def expanded():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, ke, ve)

        fn = expanded
    t = time_fn(fn, "cuda", repeats)
    b = sdpa_bytes(context, batch, shape, expanded=layout == "expanded")
    return {"layout": layout, "timing": t, "read_bytes": b["read_total"], "write_bytes": b["write_total"]}


# --------------------------------------------------------------------------------------------- rows
def device_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``: a file-name-safe device tag."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-device"


def kernel_row(
    plan: Plan, acct: dict[str, int], result: dict[str, Any] | None, copy_gbps: float, sdpa: dict | None = None
) -> dict[str, Any]:
    """One result row: the case, its byte accounting, timing, bandwidth fractions, and SDPA beside it."""
    row: dict[str, Any] = {**plan.describe(), "bytes": dict(acct)}
    row["read_bytes"], row["traffic_bytes"] = acct["read_total"], acct["traffic_total"]
    if result is None:
        return row
    if "skipped" in result:
        row["status"], row["reason"] = "skipped", result["skipped"]
        return row
    if "error" in result:
        row["status"], row["reason"] = "error", result["error"]
        return row
    t = result["timing"]
    sec = t["ms_median"] / 1e3
    row["status"] = "ok"
    row["timing"] = t
    row["ms"] = t["ms_median"]
    row["read_gbps"] = acct["read_total"] / sec / 1e9
    row["traffic_gbps"] = acct["traffic_total"] / sec / 1e9
    row["read_fraction"] = row["read_gbps"] / copy_gbps if copy_gbps else None
    row["traffic_fraction"] = row["traffic_gbps"] / copy_gbps if copy_gbps else None
    if "check" in result:
        row["check"] = result["check"]
    if sdpa is not None:
        if "skipped" in sdpa or "error" in sdpa:
            row["sdpa"] = dict(sdpa)
        else:
            row["sdpa"] = {
                "layout": sdpa["layout"],
                "ms": sdpa["timing"]["ms_median"],
                "timing": sdpa["timing"],
                "read_bytes": sdpa["read_bytes"],
            }
            row["sdpa"]["read_gbps"] = sdpa["read_bytes"] / (sdpa["timing"]["ms_median"] / 1e3) / 1e9
            row["speedup_vs_sdpa"] = sdpa["timing"]["ms_median"] / t["ms_median"]
            row["bytes_ratio_vs_sdpa"] = sdpa["read_bytes"] / acct["read_total"]
            # 1.0: faster exactly in proportion to the bytes saved
            row["speedup_per_bytes_ratio"] = row["speedup_vs_sdpa"] / row["bytes_ratio_vs_sdpa"]
    return row


def summarize_targets(rows: Sequence[dict[str, Any]], e2e: dict[str, Any] | None) -> dict[str, Any]:
    """The issue's targets, read off the rows: reported, never asserted (a missing figure is None)."""
    big = [
        r
        for r in rows
        if r.get("status") == "ok" and r["context"] >= TARGET_MIN_CONTEXT and r["batch"] >= TARGET_MIN_BATCH
    ]
    bandwidth: dict[str, Any] = {}
    vs_sdpa: dict[str, Any] = {}
    for kind in sorted({r["kind"] for r in rows}):
        fr = [r["read_fraction"] for r in big if r["kind"] == kind and r.get("read_fraction") is not None]
        bandwidth[kind] = {
            "cases": len(fr),
            "min": min(fr) if fr else None,
            "median": statistics.median(fr) if fr else None,
            "met": (min(fr) >= TARGET_FRACTION) if fr else None,
        }
        pr = [r for r in big if r["kind"] == kind and "speedup_per_bytes_ratio" in r]
        vs_sdpa[kind] = {
            "cases": len(pr),
            "median_speedup": statistics.median([r["speedup_vs_sdpa"] for r in pr]) if pr else None,
            "median_bytes_ratio": statistics.median([r["bytes_ratio_vs_sdpa"] for r in pr]) if pr else None,
            "median_speedup_per_bytes_ratio": (
                statistics.median([r["speedup_per_bytes_ratio"] for r in pr]) if pr else None
            ),
        }
    out: dict[str, Any] = {
        "kernel_bandwidth": {
            "target": f">= {TARGET_FRACTION:.0%} of copy bandwidth for the bytes read, "
            f"context >= {TARGET_MIN_CONTEXT} and batch >= {TARGET_MIN_BATCH}",
            **bandwidth,
        },
        "kernel_vs_sdpa": {"target": "speedup over flash SDPA in proportion to bytes saved (ratio ~ 1)", **vs_sdpa},
    }
    if e2e and e2e.get("speedup") is not None and e2e.get("compression_ratio"):
        out["e2e"] = {
            "target": "decode speed-up over DynamicCache >= compression ratio / 2",
            "speedup": e2e["speedup"],
            "compression_ratio": e2e["compression_ratio"],
            "met": e2e["speedup"] >= e2e["compression_ratio"] / 2,
        }
    return out


# -------------------------------------------------------------------------------------------- plot
def plot(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Achieved fraction of copy bandwidth (top) and speed-up over SDPA (bottom) vs context, per kind and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.get("kernel_rows", []) if r.get("status") == "ok" and r.get("read_fraction") is not None]
    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)] or list(KINDS)
    fig, axes = plt.subplots(2, len(kinds), figsize=(4.6 * len(kinds), 7.2), squeeze=False, sharex=True)
    batches = sorted({r["batch"] for r in rows})
    cmap = plt.get_cmap("viridis")
    for j, kind in enumerate(kinds):
        top, bottom = axes[0][j], axes[1][j]
        for i, b in enumerate(batches):
            rs = sorted((r for r in rows if r["kind"] == kind and r["batch"] == b), key=lambda r: r["context"])
            if not rs:
                continue
            color = cmap(i / max(1, len(batches) - 1))
            top.plot([r["context"] for r in rs], [r["read_fraction"] for r in rs], "o-", color=color, label=f"B={b}")
            sp = [r for r in rs if "speedup_vs_sdpa" in r]
            if sp:
                x = [r["context"] for r in sp]
                bottom.plot(x, [r["speedup_vs_sdpa"] for r in sp], "o-", color=color, label=f"B={b}")
                bottom.plot(x, [r["bytes_ratio_vs_sdpa"] for r in sp], ":", color=color, lw=0.8)
        top.axhline(TARGET_FRACTION, color="red", lw=0.8, ls="--")
        top.axhline(1.0, color="grey", lw=0.6)
        top.set_title(f"{kind}: bytes read / time / copy bandwidth", fontsize=9)
        bottom.axhline(1.0, color="grey", lw=0.6)
        bottom.set_title(f"{kind}: speed-up over flash SDPA (dotted: bytes ratio)", fontsize=9)
        bottom.set_xlabel("context (tokens)")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        top.set_ylim(bottom=0)
    axes[0][0].set_ylabel("fraction of copy bandwidth")
    axes[1][0].set_ylabel("SDPA time / kernel time")
    axes[0][0].legend(fontsize=7)
    copy = result.get("copy_bandwidth", {}).get("gbps")
    title = f"hfkv paged decode attention on {result.get('device', '?')}"
    if copy:
        title += f" (copy bandwidth {copy:.0f} GB/s, read + write)"
    e2e = result.get("e2e") or {}
    if e2e.get("speedup") is not None:
        title += (
            f"\nend to end {e2e['context']} x {e2e['batch']}: hfkv {e2e['speedup']:.2f}x faster than DynamicCache "
            f"at {e2e['compression_ratio']:.1f}x compression"
        )
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    write_atomic(path, buf.getvalue())


# ------------------------------------------------------------------------------------------ end to end
def _free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.synchronize()


def run_e2e(args, device: str = "cuda", model_name: str = "llama-3.1-8b") -> dict[str, Any]:
    """Decode step time and peak memory of DynamicCache and the hfkv cache on a random Llama-3.1-8B in bf16.

    The caches run one after the other (not side by side) so each peak is its own: the allocator's
    peak above the weights over the prefill and the decode steps, i.e. cache plus activations.
    ``device`` / ``model_name`` exist for a CPU smoke run of this code path (no peak memory there).
    """
    from transformers import DynamicCache

    from hfkv import TriStateCache
    from hfkv.evaluation.bench import Clock, decode_step, fill_cache, random_prompt
    from hfkv.evaluation.shapes import build_random_like
    from hfkv.storage.memory import cache_bytes

    context, batch = args.e2e_context, args.e2e_batch
    t0 = time.perf_counter()
    cuda = torch.device(device).type == "cuda"
    shape = get_shape(model_name)
    model = build_random_like(model_name, dtype=torch.bfloat16, device=device, max_positions=max(131072, context + 256))
    out: dict[str, Any] = {
        "model": f"random {model_name} shape ({shape.layers} layers, {shape.kv_heads} KV heads x {shape.dim}), bf16",
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "context": context,
        "batch": batch,
        "budget_fp_tokens": args.budget,
        "decode_steps": args.e2e_steps,
        "warmup": args.e2e_warmup,
        "prefill_chunk": args.e2e_chunk,
        "hfkv_prefill_chunk": args.e2e_hfkv_chunk,
        "build_s": round(time.perf_counter() - t0, 1),
        "caches": {},
    }
    print(f"e2e: model built in {out['build_s']} s", flush=True)
    ids = random_prompt(model.config.vocab_size, batch, context).to(device)
    clock = Clock(device)
    for name in ("dynamic", "hfkv"):
        _free_cuda()
        base = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        entry: dict[str, Any] = {}
        cache = None
        try:
            t1 = time.perf_counter()
            if name == "dynamic":
                cache = DynamicCache(config=model.config)
                tok = fill_cache(model, cache, ids, args.e2e_chunk)
            else:
                cache = TriStateCache(model, "hfkv", budget=args.budget, backend="triton")
                # The first chunk takes the prefill path (torch SDPA); later chunks attend through the
                # paged kernel, which holds a KV head's whole GQA group x chunk in one program, so they
                # are kept short (--e2e-hfkv-chunk).
                first = min(args.e2e_chunk or context, context)
                tok = fill_cache(model, cache, ids[:, :first], first)
                if first < context:
                    tok = fill_cache(model, cache, ids[:, first:], args.e2e_hfkv_chunk)
            if cuda:
                torch.cuda.synchronize()
            entry["prefill_s"] = time.perf_counter() - t1
            times: list[float] = []
            for i in range(args.e2e_warmup + args.e2e_steps):
                t = clock.start()
                tok = decode_step(model, cache, tok, context + i)
                clock.stop(t, times)
            clock.resolve()
            times = times[args.e2e_warmup :]
            entry["step_ms_median"] = 1e3 * statistics.median(times)
            entry["step_ms_p20"] = 1e3 * _percentile(times, 0.2)
            entry["step_ms_p80"] = 1e3 * _percentile(times, 0.8)
            entry["peak_bytes"] = int(torch.cuda.max_memory_allocated() - base) if cuda else None
            entry["kv_bytes"] = int(cache_bytes(cache))
            if name == "hfkv":
                st = cache.stats()
                entry["compression_ratio"] = st.compression_ratio
                entry["dense_bytes"] = int(st.dense_bytes)
                entry["backend"] = st.backend
            print(
                f"e2e {name:<8} prefill {entry['prefill_s']:.1f} s  step {entry['step_ms_median']:.2f} ms  "
                f"peak {_gib(entry['peak_bytes'] or 0)}  kv {_gib(entry['kv_bytes'])}",
                flush=True,
            )
        except Exception as exc:  # noqa: BLE001 - an OOM or kernel failure is a result, not a crash
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            print(f"e2e {name}: {entry['error']}", file=sys.stderr, flush=True)
        finally:
            del cache
            _free_cuda()
        out["caches"][name] = entry
    dyn, hf = out["caches"].get("dynamic", {}), out["caches"].get("hfkv", {})
    if "step_ms_median" in dyn and "step_ms_median" in hf:
        out["speedup"] = dyn["step_ms_median"] / hf["step_ms_median"]
        out["compression_ratio"] = hf.get("compression_ratio")
        out["kv_ratio"] = dyn["kv_bytes"] / hf["kv_bytes"] if hf.get("kv_bytes") else None
        out["peak_ratio"] = dyn["peak_bytes"] / hf["peak_bytes"] if hf.get("peak_bytes") else None
    del model
    _free_cuda()
    return out


# -------------------------------------------------------------------------------------------- command
def _ints(text: str, option: str) -> list[int]:
    try:
        vals = [int(x) for x in parse_list(text)]
    except ValueError:
        raise SystemExit(f"{option}={text!r} must be comma-separated positive integers") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"{option}={text!r} must be comma-separated positive integers")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eval/kernel_bench.py",
        description=__doc__.splitlines()[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--contexts", default=DEFAULT_CONTEXTS, help="tokens per row (default: %(default)s)")
    p.add_argument("--batches", default=DEFAULT_BATCHES, help="batch sizes (default: %(default)s)")
    p.add_argument("--kinds", default=",".join(KINDS), help="storage kinds (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=50, help="timed calls per case, median reported (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    p.add_argument("--no-graph", action="store_true", help="time eager launches instead of CUDA-graph replays")
    p.add_argument("--no-check", action="store_true", help="skip the check against the torch twin")
    p.add_argument("--skip-kernels", action="store_true", help="only the end-to-end figure")
    p.add_argument("--skip-e2e", action="store_true", help="only the kernel sweep")
    p.add_argument("--budget", type=int, default=2048, help="hfkv budget in fp_tokens per KV head (default 2048)")
    p.add_argument("--e2e-context", type=int, default=32768, help="end-to-end prompt length (default 32768)")
    p.add_argument("--e2e-batch", type=int, default=8, help="end-to-end batch (default 8)")
    p.add_argument("--e2e-steps", type=int, default=32, help="timed decode steps (default 32)")
    p.add_argument("--e2e-warmup", type=int, default=4, help="untimed decode steps first (default 4)")
    p.add_argument("--e2e-chunk", type=int, default=4096, help="prefill chunk (default 4096)")
    p.add_argument(
        "--e2e-hfkv-chunk",
        type=int,
        default=16,
        help="hfkv prefill chunk after the first (default 16: the kernel keeps group x chunk rows in one program)",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    return p


def _load(path: Path) -> dict[str, Any]:
    if path.exists():
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return {}
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.exit(
            2,
            "eval/kernel_bench.py needs a CUDA GPU: it measures the Triton decode kernel's bandwidth on the "
            "device (torch.cuda.is_available() is False here). The kernels' correctness tests run on a CPU: "
            "pytest tests/test_kernel_decode_attention.py (Triton's interpreter).\n",
        )
    kinds = parse_list(args.kinds)
    bad = sorted(set(kinds) - set(KINDS))
    if bad or not kinds:
        parser.error(f"--kinds={args.kinds!r}: unknown {bad}; allowed: {','.join(KINDS)}")
    contexts, batches = _ints(args.contexts, "--contexts"), _ints(args.batches, "--batches")
    for opt in ("repeats", "e2e_steps", "e2e_context", "e2e_batch", "e2e_hfkv_chunk"):
        if getattr(args, opt) < 1:
            parser.error(f"--{opt.replace('_', '-')} must be >= 1")

    import triton

    name = torch.cuda.get_device_name(0)
    slug = device_slug(name)
    out_dir = Path(args.out)
    json_path = out_dir / f"kernel_bench_{slug}.json"
    png_path = out_dir / f"kernel_bench_{slug}.png"
    shape = AttnShape.like("llama-3.1-8b")
    result = _load(json_path)  # a re-run replaces what it measures and keeps the rest (split runs)
    props = torch.cuda.get_device_properties(0)
    result.update(
        {
            "device": name,
            "device_slug": slug,
            "device_memory_bytes": int(props.total_memory),
            "multiprocessors": props.multi_processor_count,
            "cuda": torch.version.cuda,
            "triton": triton.__version__,
            "args": vars(args),
            "shape": {"heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "dtype": "bf16"},
            "kinds": {
                "full": "every token in the original tier (model/model records)",
                "quant": "every token in the quantized tier (hfkv preset: K int4 / V int2, group 32)",
                "hfkv": f"ring of {hfkv_window_slots()} bf16 tokens (window + interval, full), every "
                f"{HFKV_EXACT_EVERY}th other token exact, the rest K4V2",
            },
            "accounting": "read_* = bytes the call must read (query, ring K/V and positions, live records' K/V "
            "and tags, page tables); overhead_* = what the kernel moves beyond that; fractions are over the "
            "measured copy bandwidth",
            **provenance(machine=name),
        }
    )

    def save() -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(json_path, json.dumps(json_safe(result), indent=1, sort_keys=True) + "\n")

    if not args.skip_kernels:
        result["copy_bandwidth"] = copy = measure_copy_bandwidth()
        copy_gbps = copy["gbps"]
        print(f"{name}: copy bandwidth {copy_gbps:.0f} GB/s (read + write)", flush=True)
        save()
        _free_cuda()  # the copy buffers go back to the device before its free memory is read
        free = torch.cuda.mem_get_info()[0]
        cases = enumerate_cases(kinds, contexts, batches, shape, free)
        rows = {(r["kind"], r["context"], r["batch"]): r for r in result.get("kernel_rows", [])}
        checked: set[str] = set()
        sdpa_done: dict[tuple[int, int], dict] = {}
        for case in cases:
            plan = case.plan
            key = (plan.context, plan.batch)
            if key not in sdpa_done:
                _free_cuda()
                if case.sdpa_skip:
                    sdpa_done[key] = {"skipped": case.sdpa_skip}
                else:
                    try:
                        sdpa_done[key] = bench_sdpa(plan.context, plan.batch, shape, args.repeats, free)
                    except Exception as exc:  # noqa: BLE001
                        sdpa_done[key] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                _free_cuda()
            acct = kernel_bytes(plan)
            if case.skip:
                res: dict[str, Any] = {"skipped": case.skip}
            else:
                try:
                    small = plan.batch * shape.kv_heads * plan.context <= CHECK_MAX_RECORDS
                    check = not args.no_check and small and plan.kind not in checked
                    res = bench_kernel_case(plan, "cuda", args.repeats, args.warmup, not args.no_graph, check)
                    if check:
                        checked.add(plan.kind)
                except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
                    res = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
                _free_cuda()
            row = kernel_row(plan, acct, res, copy_gbps, sdpa_done[key])
            row["memory_need_bytes"] = case.need
            row["copy_gbps"] = copy_gbps  # rows kept from an earlier run keep the copy bandwidth they used
            rows[(plan.kind, plan.context, plan.batch)] = row
            result["kernel_rows"] = sorted(
                rows.values(), key=lambda r: (KINDS.index(r["kind"]), r["context"], r["batch"])
            )
            save()
            if row.get("status") == "ok":
                sd = row.get("sdpa", {})
                vs = (
                    f"sdpa {sd['ms']:.3f} ms -> {row['speedup_vs_sdpa']:.2f}x (bytes {row['bytes_ratio_vs_sdpa']:.2f}x)"
                    if "ms" in sd
                    else f"sdpa {sd.get('skipped') or sd.get('error')}"
                )
                chk = f" check {row['check'].get('rel_err', float('nan')):.1e}" if "check" in row else ""
                print(
                    f"{plan.kind:<5} T={plan.context:>6} B={plan.batch:>2} read {acct['read_total'] / 1e6:9.1f} MB "
                    f"{row['ms']:8.3f} ms {row['read_gbps']:6.0f} GB/s ({row['read_fraction']:.0%} of copy) "
                    f"{vs}{chk}",
                    flush=True,
                )
            else:
                print(f"{plan.kind:<5} T={plan.context:>6} B={plan.batch:>2} {row['status']}: {row['reason']}")
    if not args.skip_e2e:
        result["e2e"] = run_e2e(args)
        save()
    result["targets"] = summarize_targets(result.get("kernel_rows", []), result.get("e2e"))
    save()
    try:
        plot(result, png_path)
    except ImportError as exc:
        print(f"no plot ({exc}); the JSON has every figure", file=sys.stderr)
    print(json.dumps(json_safe(result["targets"]), indent=1))
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
