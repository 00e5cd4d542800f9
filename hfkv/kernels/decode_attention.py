"""Paged attention of new queries over the window ring and the tiers, reading the compressed pages.

Decode attention is bandwidth-bound, so a step gets faster in proportion to the bytes it no
longer reads only if one kernel reads the packed records, dequantizes them in registers and never
materialises dense keys. The work is three small kernels (flash-decoding):

``_partial_kernel`` (masked logits and an online softmax per split of slots), ``_combine_kernel`` (one
softmax per query row from the splits) and ``_score_kernel`` (the significance scores from the stored
logits, with no second read of K), in :mod:`hfkv.kernels.decode_kernels`. This module plans them:
it chooses the launch shape, splits the slots into programs, gathers each part's pointers and sizes
(the ``meta`` rows) and launches the three. Grid sizes come from host-known maxima (table widths, the
ring's capacity), so a step makes no host sync.

``paged_attention_reference`` (:mod:`hfkv.kernels.reference`) is the torch twin, built on the torch
backend's own reading and attention code; the tests compare the two.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import triton.language as tl

from hfkv.kernels.decode_kernels import META_COLS, _combine_kernel, _partial_kernel, _score_kernel
from hfkv.kernels.dequant import format_constants, piece_width, tl_dtype
from hfkv.kernels.environment import inline_ptx_ok, interpreter_on, triton_version
from hfkv.kernels.grid import cdiv
from hfkv.kernels.launch import KernelLaunch, shortcut_supported
from hfkv.kernels.parts import DenseSlots, PagedSlots, Part, plan_key
from hfkv.kernels.reference import REDUCTIONS, check_call, paged_attention_reference

if TYPE_CHECKING:
    from hfkv.quant.record import RecordLayout

__all__ = [
    "DecodePlan",
    "DenseSlots",
    "PagedSlots",
    "Part",
    "paged_attention",
    "paged_attention_reference",
    "plan_attention",
    "plan_key",
    "run_plan",
]


# The partial pass's launch shape: slots per loop iteration, warps, pipeline stages, and how integer codes
# are read. On an H100 (bf16, Llama-3.1-8B's shape, 32k x 8; eval/results/gpu/kernel_variants_h100_pieces.json)
# 64 / 8 / 2 with integer fields read in pieces was the fastest or within 1% of the old 128 / 4 / 2 rows for
# every storage (hfkv 0.735 vs 0.754 ms, quant 0.741 vs 0.745, hfkv at batch 1 0.128 vs 0.129) and 64 / 8
# was the fastest for full-precision pages (0.623 ms; H200 run 3 and the H100 storage sweep). Reading codes
# per element was 4x slower for every shape (kernel_variants_h200_run2.json).
BLOCK_N = 64
# Warps of the partial pass; None: 4 where a paged part holding slots has an integer field, else 8. H200, 32k x 8
# (kernel_variants_h200_run5.json, the default code options): quant 0.461 ms at 4 warps against 0.527 at 8, hfkv
# 0.498 against 0.534; runs 2 and 3 there (block 128) 0.72 / 0.70 against 0.95 / 0.89 (quant) and 0.74 / 0.72
# against 0.94 / 0.90 (hfkv); H100 (kernel_variants_h100_pieces.json) quant 0.677 against 0.741, hfkv 0.754
# against 0.735. Full-precision pages stay at 8 (0.625 against 0.631, H200 run 2).
NUM_WARPS = None
NUM_STAGES = 2
INT_TILE = True
# Integer fields read in pieces, their columns in the pieces' order (``load_int_pieces``): sm_90 code
# without the per-element trips through shared memory of ``load_field``'s rows (118 -> 72 warp
# instructions per slot in the loop).
INT_PIECES = True
# Integer fields dequantized in fp16 where the products run in a 16-bit type (``load_int_pieces``' HALF: two
# codes per 32-bit op OR'd into fp16 mantissas, one subtraction and one fused multiply-add per pair; the
# products in fp16 with fp32 accumulation): sm_90 loop of the quant storage at 4 warps 74.1 -> 69.9
# warp-instructions a slot with the device image's Triton 3.6 (eval/results/kernel_sass_half_default_triton36.json).
# The fastest launch of the H200 sweep at 32k x 8 for both quantized storages (kernel_variants_h200_run5.json:
# quant 0.384 ms, hfkv 0.470) and the closer to exact attention: rounding dequantized values to bf16 is what moved
# the other launches' outputs 3% from its own there (eval/dequant_rounding.py: in bf16, 2.9% from exact against
# 0.2% on that storage, 0.31-0.33% against 0.18% on SmolLM2's layers over human-written documents).
HALF_DEQUANT = True
# The partial pass's softmax denominators summed per column of its tile and reduced across the warps once, at the end,
# instead of a row sum every iteration (two barriers fewer an iteration). sm_90 loop with the device image's Triton
# 3.6 (eval/results/kernel_sass_column_sums_triton36.json): barriers 10 -> 7 and 437 -> 408 instructions for full
# pages, 12 -> 9 and 737 -> 711 for quant; registers +5 for the integer tiers, -5 for full pages. The same arithmetic
# in another order; on by default from the machine code alone, and swept (--column-sums 0,1) on the next GPU lease.
COLUMN_SUMS = True
# Integer tiles read in pieces reach the two products through an opaque identity (``operand_fence``) with the
# Triton versions whose operand-width heuristic halves at a ``tl.join`` (3.7 and before): they gave the pieces' tiles
# fragments of width 4, so register moves rebuilt every HMMA's operands. sm_90 loop of the quant storage at the 4-warp
# default (eval/results/kernel_sass_operand_fence_*.json, warp-instructions a slot): Triton 3.6 (the device image's)
# 69.9 -> 59.0, 3.7.1 70.5 -> 58.6; 3.8 and 3.9 give width 2 unaided (56.2 and 58.4) and the fence adds nothing
# there (56.4, 59.2). Compiled code only: the interpreter runs no inline assembly.
OPERAND_FENCE = triton_version() < (3, 8)
# The fp16 form's per-pair arithmetic written as PTX (``half_pair_asm``: one lop3 and two HFMA2 / HADD2 a pair of codes)
# where Triton left pairs' operations on one lane and repacked the rest. sm_90 loop of the quant storage at the 4-warp
# default (eval/results/kernel_sass_asm_dequant_*.json, warp-instructions a slot, with the pieces' lanes as neighbouring
# columns, each plane read in place): Triton 3.6 60.9 -> 44.4 (fenced), 3.7.1 60.8 -> 44.2, 3.8 56.1 -> 42.2, 3.9 55.1
# -> 42.5. Compiled code only: the interpreter runs the same arithmetic written in Triton. H200, 32k x 8
# (eval/results/gpu/kernel_variants_h200_run6.json): the same distance from the torch twin as without it and faster in
# all 12 launch pairs (quant 0.398 -> 0.384 ms uncapped, 0.353 -> 0.318 at 128 registers).
ASM_DEQUANT = True
# Integer tiles' columns ordered so the tile's trip to shared memory for the tensor cores is free of bank conflicts
# (``load_int_pieces``' SPREAD: the column bit that two lanes reading a piece tell apart moved to column bit 5). H200
# ncu of the quant storage's partial pass (eval/results/gpu/ncu_partial_h200_quant_32768x8_memory_ops.csv): each of
# the 16 ``STS.128`` an iteration took 8 wavefronts where 4 would do, a sixth of the L1 work of a pass bound by L1
# (88% busy, DRAM 24%). sm_90 code (Triton 3.6): lane 0 holds column 32 instead of 64 (``eval/kernel_sass.py``'s
# ``tile_lane_columns``); loop 720 -> 718 instructions, the same registers. A relabelling of the tile's columns: the
# queries are read and the output stored in its order, the values the same.
SPREAD_BANKS = True
# The products taken from integer fields' code bytes (``hfkv.kernels.code_products``): bit 0 the keys', 1 the values'.
# Each piece's bytes reach the tensor cores' operand layout by an asynchronous copy and are dequantized there, in
# registers, where the default dequantizes a tile and stores it to shared memory and loads it back, the traffic that
# bounds the quantized pass (docs/kernels.md: L1 88% busy on the H200). sm_90 code (Triton 3.6,
# eval/results/kernel_sass_code_dots_triton36.json): no fp16 tile stored; keys alone 825 instructions a loop against
# 748 at the same table read-ahead, their shared-memory requests 92 KiB an iteration against 122; both 1,065. Off until
# a GPU lease times it (eval/kernel_variants.py --code-dots 0,1,2,3).
CODE_DOTS = 0
# Registers per thread the partial pass may use (Triton's ``maxnreg``; 0: the compiler's choice; None: per storage,
# INT_REGISTERS where a part holding slots has an integer field, else FULL_REGISTERS). The quantized pass ran at 112
# registers x 256 threads, two programs per SM (25% occupancy, the register limit; ncu, H100) and issued on 40% of
# cycles. At 4 warps with the PTX dequantization it takes 167 (three programs an SM; sm_90 code, Triton 3.6); capped
# at 128 it fits four (quant without spills, hfkv with a few). H200, 32k x 8, block 64, PTX dequantization
# (eval/results/gpu/kernel_variants_h200_run6.json, first lease after it): quant 0.384 -> 0.318 ms uncapped -> 128,
# 0.334 at 168; hfkv 0.419 -> 0.350, 0.353 at 168; the same order with Triton's own arithmetic. Full-precision pages
# (FULL_REGISTERS; 0: the compiler's) take 103 registers at 8 warps with their table read one ahead (two programs an
# SM; 80 fits three with 16 bytes of stack, eval/results/kernel_sass_full_registers_triton36.json). The H200 sweep
# that capped them (eval/results/gpu/kernel_variants_h200_run8.json: 0.496 / 0.479 ms uncapped, 0.440 at 80) read
# their table two ahead, a slower launch (112 registers, no cp.async). At the library's own launch (table one ahead)
# the cap wins too: 0.353-0.365 ms at 80 against 0.386-0.395 uncapped, in four pairs of turns over both page
# layouts (eval/results/gpu/kernel_variants_h200_run9_full_registers.json, code c860655).
MAX_REGISTERS = None
INT_REGISTERS = 128
FULL_REGISTERS = 80
_REGISTER_CAPS = (0, 64, 72, 80, 96, 128, 168, 255)
# Programs the partial pass launches over all (row, head) pairs when it sizes its own splits: one wave, the device's
# SMs times the programs an SM holds. Uncapped, the partial pass takes 97-128 registers a thread: 16 warps an SM,
# two programs of 8 (ncu, H100: 256 programs, 0.97 waves; the sizing before this counted 256 on any device).
WARPS_PER_SM = 16
SPLIT_PROGRAMS = 256  # off a GPU
# Iterations ahead of its use that the page table is read (0: where it is used). None: two where a paged
# part has an integer field, else one (H100, 64 / 8 / 2, 32k x 8; kernel_variants_h100_ahead.json: hfkv
# storage 0.720 / 0.717 / 0.698 ms at 0 / 1 / 2 ahead, quant 0.722 / 0.718 / 0.680, full pages 0.664 /
# 0.641 / 0.727).
TABLE_AHEAD = None
# Slots per program of the score pass (eval/kernel_variants.py --score-block): the pass reads the logits and adds
# each slot's share to its score. H100, 32k x 8, with the score inside each record (a scattered 4 bytes): 64 /
# 128 / 256 slots made no difference (full 0.646 / 0.657 / 0.667 ms a call): the pass was bound by those sectors,
# which is why a page keeps its scores side by side (hfkv.quant.record).
SCORE_BLOCK = 64


def launch_defaults() -> dict[str, Any]:
    """The partial pass's launch options as this code sets them by default: results files record them, since the
    defaults follow what each GPU lease measured."""
    return {
        "block_n": BLOCK_N,
        "num_warps": NUM_WARPS,
        "num_stages": NUM_STAGES,
        "int_tile": INT_TILE,
        "int_pieces": INT_PIECES,
        "half_dequant": HALF_DEQUANT,
        "column_sums": COLUMN_SUMS,
        "operand_fence": OPERAND_FENCE,
        "asm_dequant": ASM_DEQUANT,
        "spread_banks": SPREAD_BANKS,
        "code_dots": CODE_DOTS,
        "max_registers": MAX_REGISTERS,
        "int_registers": INT_REGISTERS,
        "full_registers": FULL_REGISTERS,
        "table_ahead": TABLE_AHEAD,
        "score_block": SCORE_BLOCK,
    }


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=256)
def _paged_constants(lay, page_align: int, tpp: int) -> tuple:
    """A paged part's ``FMT`` for the partial kernel (``_partial_part``), built once per layout.

    Entries 13 and 14 are the byte alignment every record's key and value field start is known to
    have (``field_align``): the compiler cannot see it through a page number loaded from the table and
    a page size it is not allowed to specialise on, and without it every load is one element wide
    (the third H200 run: full-precision storage at half the speed of the run before).
    """
    kc, vc = format_constants(lay.key), format_constants(lay.value)
    fields = [(c["fam"], c["bits"], c["group"], c["dtype"]) for c in (kc, vc)]
    aligns = (field_align(lay.stride, page_align, 0), field_align(lay.stride, page_align, lay.key.nbytes))
    # Pieces are read as 32-bit words: a field that may start off a 4-byte boundary keeps load_field's read.
    pieces = tuple(piece_width(f) if a >= 4 else 0 for f, a in zip((lay.key, lay.value), aligns, strict=True))
    # Records per page last: a constant of the storage (never of a policy run), so a slot's page and place in
    # it are a multiply and a shift, not a division by a loaded value (two per slot and iteration).
    return (True, False, lay.stride, lay.key.nbytes, lay.tag_region(tpp), *fields[0], *fields[1], *aligns, *pieces, tpp)


def held_integers(held: Iterable[tuple[int, RecordLayout]]) -> bool:
    """Whether a paged part holding slots has an integer field, from ``(slots, layout)`` pairs of the paged parts
    (an empty tier launches no program): what the launch defaults follow (warps, table read-ahead)."""
    return any(n and (piece_width(lay.key) or piece_width(lay.value)) for n, lay in held)


def _reads_integers(parts: Sequence[Part]) -> bool:
    return held_integers((p.slots, p.layout) for p in parts if isinstance(p, PagedSlots))


def _table_ahead(parts: Sequence[Part], code_dots: int = 0) -> int:
    """How many iterations ahead the partial pass reads the page table, by default (see ``TABLE_AHEAD``). Products
    from codes (``code_dots``) read it one ahead: two ahead, Triton 3.6's pipeliner issued no asynchronous copy at all
    (sm_90 code), and the codes' trip to the operand layout is one."""
    return 2 if _reads_integers(parts) and not code_dots else 1


def default_num_warps(integer: bool) -> int:
    """The partial pass's warps where ``NUM_WARPS`` leaves them to the storage (see there)."""
    return (4 if integer else 8) if NUM_WARPS is None else NUM_WARPS


def default_max_registers(integer: bool) -> int:
    """The partial pass's register cap where ``MAX_REGISTERS`` leaves it to the storage (see there; 0: none)."""
    return (INT_REGISTERS if integer else FULL_REGISTERS) if MAX_REGISTERS is None else MAX_REGISTERS


def field_align(record_bytes: int, page_align: int, offset: int) -> int:
    """The largest power of two up to 16 dividing the byte address of a field at ``offset`` in every
    record: the pool's base and page size (``page_align``), the record size and the offset all must."""
    a = math.gcd(record_bytes, page_align, 16)
    if offset:
        a = math.gcd(a, offset)
    return a & -a


def _page_align(pool: torch.Tensor) -> int:
    """What divides the pool's base address and its page size (bytes), capped at 16."""
    return math.gcd(pool.data_ptr(), pool.shape[1], 16)


def _dense_constants(part: DenseSlots, dim: int, write: bool) -> tuple:
    """A dense part's ``FMT``: full-precision rows in the model dtype; ``write``: it takes the ring's new token."""
    dt, bits = tl_dtype(part.k.dtype), 8 * part.k.element_size()
    return (False, write, 4, 0, 0, 0, bits, dim, dt, 0, bits, dim, dt, 1, 1, 0, 0, 1)


# --------------------------------------------------------------------------------------------- wrappers


def _table_args(part: PagedSlots) -> tuple:
    """``(pool, table, stride of b, stride of h, tpp, page_bytes)`` as the kernels index a paged part.

    The kernels take the table's row strides rather than assuming ``[B, H, W]`` is contiguous, so a
    table that is a view (a slice of a wider table) is read where it lies; only its columns must be
    adjacent. Every offset into the table and the pool is formed in 64 bits from these, so neither
    may pass 2^31 elements or bytes unnoticed (tests/test_kernel_offsets64.py).
    """
    table = part.table if part.table.stride(-1) == 1 else part.table.contiguous()
    return part.pool, table, table.stride(0), table.stride(1), part.tpp, part.pool.shape[1]


_NO_WRITE = (None, None, 0, 0, 0, 0, 0, 0)


def _write_args(write, part: Part, bsz: int, heads: int, dim: int) -> tuple:
    """The partial kernel's ``wk_ptr .. w_pos`` for a pending ring write into ``part`` (or none)."""
    if write is None:
        return _NO_WRITE
    if not (isinstance(part, DenseSlots) and all(t.is_contiguous() for t in (part.k, part.v, part.pos))):
        raise ValueError("paged_attention: window_write needs the first part to be a contiguous dense ring")
    k, v = write.k, write.v
    if k.shape != (bsz, heads, 1, dim) or v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"paged_attention: window_write k/v must be [{bsz}, {heads}, 1, {dim}] with unit-stride rows")
    if k.dtype != part.k.dtype or v.dtype != part.v.dtype:
        raise ValueError(f"paged_attention: window_write dtype {k.dtype} differs from the ring's {part.k.dtype}")
    if not 0 <= write.slot < part.slots:
        raise ValueError(f"paged_attention: window_write slot {write.slot} is outside the ring's {part.slots} slots")
    return k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), write.slot, write.pos


def _split_slots(
    n: int,
    programs: int,
    block_n: int,
    split_slots: int | None,
    interp: bool | None = None,
    target: int = SPLIT_PROGRAMS,
) -> int:
    """Slots per program: enough splits that a single long sequence fills the GPU (flash-decoding); ``target``:
    the programs worth launching across all (row, head) pairs."""
    if split_slots is not None:
        return max(block_n, -(-split_slots // block_n) * block_n)
    if interpreter_on() if interp is None else interp:  # programs run one after another there: fewest is fastest
        return max(block_n, cdiv(n, block_n) * block_n)
    per_head = max(1, target // max(1, programs))  # at most one wave
    return max(block_n, cdiv(cdiv(n, per_head), block_n) * block_n)


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def programs_target(device: torch.device, num_warps: int, max_registers: int | None) -> int:
    """Programs a partial pass launches across all (row, head) pairs when it sizes its own splits: one wave.

    An SM holds as many programs as its 65,536 registers allow: ``WARPS_PER_SM`` warps uncapped (0; measured), else
    ``65536 / (max_registers x 32 x num_warps)`` programs (three 8-warp programs at 80 registers), times the
    device's SMs; a cap whose extra programs had no splits to run would buy nothing. ``SPLIT_PROGRAMS`` off a GPU.
    """
    if device.type != "cuda":
        return SPLIT_PROGRAMS
    if not max_registers:
        per_sm = max(1, WARPS_PER_SM // num_warps)
    else:
        per_sm = max(1, 65536 // (max_registers * 32 * num_warps))
    return _sm_count(device) * per_sm


@dataclass
class DecodePlan:
    """Everything about a ``paged_attention`` call that only the parts' storage decides: launch arguments
    and scratch buffers. A layer keeps one between policy runs (:func:`plan_attention`), so a decode
    step's host work is three launches (:func:`run_plan`) and no argument building."""

    key: tuple
    parts: tuple  # held, so the tensors the key names by identity stay alive
    heads: int
    p_args: tuple
    p_fmts: tuple
    s_args: tuple
    s_fmts: tuple
    p_meta: torch.Tensor  # [parts, META_COLS] int64 on the device: the partial pass's sizes per part
    s_meta: torch.Tensor  # the score pass's
    meta_host: torch.Tensor  # their pinned source, alive until the asynchronous copy has surely run
    pool: torch.Tensor
    page_bytes: int
    s_total: int
    ns_total: int
    scratch: tuple[torch.Tensor, ...]  # logits, m, l, acc, mf, lf
    ring: DenseSlots | None  # the part a window_write goes to (None: this plan takes no write)
    out_shape: tuple[int, int, int, int]
    dtype: torch.dtype
    return_delta: bool
    # the three launch sites (partial, combine, score), for a step without and with a device ``step``
    # (hfkv.kernels.launch), which hold the grids and compile-time constants: made with the plan, so a copy of it
    # (the GPU test plugin's) launches through the same sites
    launches: dict[bool, tuple[KernelLaunch, KernelLaunch, KernelLaunch]]

    @property
    def constants(self) -> dict[str, Any]:
        """The partial pass's compile-time constants and launch options."""
        return self.launches[False][0].constants


_SCRATCH: dict[torch.device, torch.Tensor] = {}


def _shared_scratch(device: torch.device, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Views of one fp32 buffer per device, grown geometrically and shared by every layer's plan.

    The layers run one after another on one stream, so one layer's logits and partials are dead when the
    next layer's partial pass writes them; a buffer per layer would hold, at 32k tokens x batch 8, tens
    of MB times the layers. A plan made before the buffer grew keeps its own (older) buffer alive until
    it is rebuilt at its layer's next policy run.
    """
    need = sum(sizes)
    buf = _SCRATCH.get(device)
    if buf is None or buf.numel() < need:
        buf = torch.empty(max(need, 2 * (buf.numel() if buf is not None else 0)), dtype=torch.float32, device=device)
        _SCRATCH[device] = buf
    out, at = [], 0
    for n in sizes:
        out.append(buf[at : at + n])
        at += n
    return out


def plan_attention(
    query: torch.Tensor,
    parts: Sequence[Part],
    pad_end: torch.Tensor,
    reduction: str = "max",
    add_scores: bool = True,
    split_slots: int | None = None,
    block_n: int = BLOCK_N,
    return_delta: bool = True,
    num_warps: int | None = None,
    num_stages: int | None = None,
    int_tile: bool = INT_TILE,
    window_write: bool = False,
    int_pieces: bool = INT_PIECES,
    table_ahead: int | None = TABLE_AHEAD,
    score_block: int = SCORE_BLOCK,
    half_dequant: bool = HALF_DEQUANT,
    max_registers: int | None = MAX_REGISTERS,
    column_sums: bool = COLUMN_SUMS,
    operand_fence: bool = OPERAND_FENCE,
    asm_dequant: bool = ASM_DEQUANT,
    spread_banks: bool = SPREAD_BANKS,
    code_dots: int = CODE_DOTS,
) -> DecodePlan:
    """The launch plan of :func:`paged_attention` for queries shaped like ``query`` over ``parts`` (same
    options; ``window_write``: calls will hand the first part, the ring, a pending token)."""
    heads, g = check_call(query, parts, pad_end, reduction)
    bsz, hq, qlen, dim = query.shape
    # A program holds the whole GQA group for a block of queries (one query when decoding); long chunks
    # are tiled over query blocks so a program's rows stay few.
    qb = min(_next_pow2(qlen), max(1, 32 // _next_pow2(g)))
    nqb = cdiv(qlen, qb)
    block_r = max(16, _next_pow2(g) * qb)
    block_d = max(16, _next_pow2(dim))
    device = query.device
    sizes = [p.slots for p in parts]
    s_total = sum(sizes)
    interp = interpreter_on()
    integer = _reads_integers(parts)
    warps = default_num_warps(integer) if num_warps is None else num_warps
    if max_registers is None:
        max_registers = default_max_registers(integer)
    target = programs_target(device, warps, max_registers)
    splits = [_split_slots(n, bsz * heads, block_n, split_slots, interp, target) for n in sizes]
    n_splits = [cdiv(n, sp) for n, sp in zip(sizes, splits, strict=True)]  # empty parts: no program
    ns_total = sum(n_splits)
    blocks = bsz * heads * nqb
    sizes_f32 = (
        blocks * g * qb * max(1, s_total),  # logits: the valid query rows of each block
        blocks * ns_total * block_r,  # m
        blocks * ns_total * block_r,  # l
        blocks * ns_total * block_r * block_d,  # acc
        blocks * block_r,  # mf
        blocks * block_r,  # lf
    )
    scratch = tuple(_shared_scratch(device, sizes_f32))
    shape = dict(G=g, QLEN=qlen, QB=qb, NQB=nqb, BLOCK_R=block_r)
    dot_t = tl_dtype(query.dtype)
    ptx = inline_ptx_ok()  # the fence and the PTX dequantization: compiled code for NVIDIA GPUs only
    if dot_t == tl.bfloat16 and interp:  # the interpreter's tl.dot reads bf16 operands as integers
        dot_t = tl.float32
    tile = bool(int_tile) and dim == block_d  # the row read needs power-of-two planes and groups
    if table_ahead not in (None, 0, 1, 2):
        raise ValueError(f"paged_attention: table_ahead={table_ahead!r}; allowed: None, 0, 1, 2")
    launch = {
        "num_warps": warps,
        "num_stages": NUM_STAGES if num_stages is None else num_stages,
    }
    if code_dots not in (0, 1, 2, 3):
        raise ValueError(f"paged_attention: code_dots={code_dots!r}; allowed: 0 (off), 1 (keys), 2 (values), 3 (both)")
    if max_registers not in _REGISTER_CAPS:
        raise ValueError(
            f"paged_attention: max_registers={max_registers!r}; allowed: None (per storage), 0 (the compiler's) or "
            f"one of {_REGISTER_CAPS[1:]}"
        )
    if max_registers and not interp:  # the interpreter runs no registers and takes no such option
        launch["maxnreg"] = int(max_registers)

    # One launch of each kernel for all parts: each part's pointers in a tuple, its sizes in a row of `meta`
    # (see META_COLS), its formats in a constant tuple, so a kernel instance holds the code of exactly the
    # parts it reads and nothing a policy run changes.
    paged = [p for p in parts if isinstance(p, PagedSlots)]
    pool = paged[0].pool if paged else query
    if any(p.pool.data_ptr() != pool.data_ptr() or p.pool.shape != pool.shape for p in paged):
        raise ValueError("paged_attention: the paged parts must share one pool (a layer's tiers do)")
    if window_write and not (parts and isinstance(parts[0], DenseSlots) and n_splits[0]):
        raise ValueError("paged_attention: window_write needs the first part to be a dense ring")
    page_bytes = pool.shape[1] if paged else 0
    # products from codes: integer fields read in pieces (a power-of-two head size), 16-bit products
    code = int(code_dots) if int_pieces and dim == block_d and dot_t != tl.float32 else 0
    p_args, p_fmts, s_args, s_fmts, p_meta, s_meta = [], [], [], [], [], []
    col0 = split0 = block0 = 0
    block_s = int(score_block)
    if block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"paged_attention: score_block={score_block!r}; allowed: a power of two >= 16")
    for idx, (part, n, sp, nsp) in enumerate(zip(parts, sizes, splits, n_splits, strict=True)):
        if nsp == 0:
            continue
        if isinstance(part, DenseSlots):
            k, v, pos = part.k.contiguous(), part.v.contiguous(), part.pos.contiguous()
            p_args.append((k, v, pos, pos))
            p_meta.append((0, 0, 1, n, sp, col0, split0, nsp))
            p_fmts.append(_dense_constants(part, dim, window_write and idx == 0))
            score = part.score
            if score is not None and not (score.is_contiguous() and score.dtype == torch.float32):
                raise ValueError("paged_attention: a dense part's score must be a contiguous fp32 tensor")
            add = add_scores and score is not None
            table_args = (pos, 0, 0, 1)
            s_fmt = (False, add, 4)
        else:
            _, table, t_sb, t_sh, tpp, _ = _table_args(part)
            p_args.append((table, table, table, table))
            p_meta.append((t_sb, t_sh, tpp, n, sp, col0, split0, nsp))
            p_fmts.append(_paged_constants(part.layout, _page_align(pool), tpp))
            score, table_args = None, (table, t_sb, t_sh, tpp)
            s_fmt = (True, add_scores, part.layout.stride)
        nblk = cdiv(n, block_s)
        s_args.append((score if score is not None else table_args[0], table_args[0]))
        s_meta.append((*table_args[1:], n, col0, block0, nblk, 0))
        s_fmts.append(s_fmt)
        col0 += n
        split0 += nsp
        block0 += nblk
    # One copy per plan (a policy run), asynchronous: from pinned memory the plan keeps alive (meta_host),
    # built from numpy so no host number is lifted into a tensor op (NoHostScalars guards the step).
    meta_host = torch.from_numpy(np.asarray([p_meta, s_meta], dtype=np.int64).reshape(2, len(p_meta), META_COLS))
    if device.type == "cuda":
        meta_host = meta_host.pin_memory()
    meta = meta_host.to(device, non_blocking=True)
    constants = dict(
        FMTS=tuple(p_fmts),
        NP=len(p_args),
        D=dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_T=dot_t,
        INT_TILE=tile,
        INT_PIECES=bool(int_pieces) and dim == block_d,
        HALF=(2 if asm_dequant and ptx else 1) if half_dequant and int_pieces and dot_t != tl.float32 else 0,
        COL_SUMS=bool(column_sums),
        FENCE=bool(operand_fence) and ptx,
        SPREAD=bool(spread_banks),
        CODE_DOTS=code,
        PTX=bool(asm_dequant) and ptx,
        TABLE_AHEAD=_table_ahead(parts, code) if table_ahead is None else int(table_ahead),
    )
    score_constants = dict(
        FMTS=tuple(s_fmts), NP=len(s_args), WRITE_DELTA=return_delta, RED=REDUCTIONS[reduction], BLOCK_S=block_s
    )
    grid = (bsz * heads, ns_total, nqb)
    p_constants, score_constants = constants | shape | launch, score_constants | shape
    bind = shortcut_supported()  # read once for the six sites
    return DecodePlan(
        key=plan_key(query, parts, window_write),
        parts=tuple(parts),
        heads=heads,
        p_args=tuple(p_args),
        p_fmts=tuple(p_fmts),
        s_args=tuple(s_args),
        s_fmts=tuple(s_fmts),
        p_meta=meta[0],
        s_meta=meta[1],
        meta_host=meta_host,
        pool=pool,
        page_bytes=page_bytes,
        s_total=s_total,
        ns_total=ns_total,
        scratch=scratch,
        ring=parts[0] if window_write else None,
        out_shape=(bsz, qlen, hq, dim),
        dtype=query.dtype,
        return_delta=return_delta,
        launches={
            dev: (
                KernelLaunch(_partial_kernel, grid, p_constants | {"DEV_STEP": dev}, bind),
                KernelLaunch(_combine_kernel, (grid[0], grid[2]), dict(D=dim, BLOCK_D=block_d, **shape), bind),
                KernelLaunch(_score_kernel, (grid[0], block0), score_constants | {"DEV_STEP": dev}, bind),
            )
            for dev in (False, True)
        },
    )


def run_plan(
    plan: DecodePlan,
    query: torch.Tensor,
    q_start: int,
    pad_end: torch.Tensor,
    scaling: float,
    window_write=None,
    checked: bool = True,
    step: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The three launches of ``plan`` for ``query`` (shaped as the plan's) at logical positions ``q_start ..``.

    ``out``: a contiguous ``[B, q, Hq, D]`` tensor of the query's dtype the output is written to (else a new one):
    a caller replaying graphs around the attention has it read where the next graph reads it, with no copy.

    ``checked=False`` skips validating ``window_write`` against the ring: for a caller whose pending write
    comes from the ring itself (the cache's, ``WindowRing.push_deferred``), where the checks are a few
    microseconds of a step's host time and can never fail.

    ``step`` (a decode step with a ``window_write``): an int64 ``[2]`` tensor on the query's device holding the
    step's ``[position, ring slot]``, which must equal ``q_start`` and the write's ``pos`` and ``slot``; the
    kernels read them from it and advance it to the next step's (``[position + 1, (slot + 1) % ring slots]``),
    so the host numbers are not launch arguments and a CUDA graph of one step replays the next ones.
    """
    if (window_write is None) != (plan.ring is None):
        raise ValueError("paged_attention: a plan made for a window_write needs one at every call, and only it")
    if step is not None and checked:
        _check_step(step, plan, query, q_start, window_write)
    bsz, qlen, hq, dim = plan.out_shape
    heads, device = plan.heads, query.device
    if (
        out is not None
        and checked
        and (out.shape != (bsz, qlen, hq, dim) or out.dtype != query.dtype or not out.is_contiguous())
    ):
        raise ValueError(
            f"paged_attention: out is {tuple(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()}); "
            f"allowed: a contiguous {(bsz, qlen, hq, dim)} {query.dtype} tensor"
        )
    query = query.contiguous()
    if pad_end.dtype != torch.int64 or pad_end.device != device:
        pad_end = pad_end.to(device=device, dtype=torch.int64)
    if window_write is None:
        wargs = _NO_WRITE
    elif checked:
        wargs = _write_args(window_write, plan.ring, bsz, heads, dim)
    else:
        k, v = window_write.k, window_write.v
        wargs = (k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), window_write.slot, window_write.pos)
    if step is not None:  # the kernels read these from `step`: no number that changes per step is an argument
        q_start, wargs = 0, (*wargs[:6], 0, 0)
    logits, m, l_, acc, mf, lf = plan.scratch
    if out is None:
        out = torch.empty(bsz, qlen, hq, dim, dtype=query.dtype, device=device)
    delta = torch.empty(bsz, heads, plan.s_total, dtype=torch.float32, device=device) if plan.return_delta else None
    partial, combine, score = plan.launches[step is not None]
    partial(
        query, pad_end, q_start, scaling, plan.pool, plan.page_bytes, plan.p_args, plan.p_meta, logits, plan.s_total,
        m, l_, acc, plan.ns_total, heads, hq, *wargs, step,
    )  # fmt: skip
    combine(m, l_, acc, plan.ns_total, out, mf, lf, heads, hq)
    score(
        logits,
        plan.s_total,
        mf,
        lf,
        delta,
        plan.pool,
        plan.page_bytes,
        plan.s_args,
        plan.s_meta,
        heads,
        step,
        plan.ring.slots if step is not None else 0,
    )
    return out, delta


def _check_step(step: torch.Tensor, plan: DecodePlan, query: torch.Tensor, q_start: int, write) -> None:
    """``run_plan``'s ``step``: a device ``[position, slot]`` of a one-token step with a ring write. Its values
    are not read here (that would wait on the device); the cache keeps them equal to the host's."""
    if write is None or plan.out_shape[1] != 1:
        raise ValueError("paged_attention: step is for a one-token decode step with a window_write")
    if step.dtype != torch.int64 or step.shape != (2,) or step.device != query.device or not step.is_contiguous():
        raise ValueError(
            f"paged_attention: step must be a contiguous int64 [2] tensor on {query.device}; got {step.dtype} "
            f"{tuple(step.shape)} on {step.device}"
        )
    if q_start != write.pos:
        raise ValueError(f"paged_attention: q_start={q_start} differs from the window_write's pos={write.pos}")


def paged_attention(
    query: torch.Tensor,
    parts: Sequence[Part],
    q_start: int,
    pad_end: torch.Tensor,
    scaling: float,
    reduction: str = "max",
    add_scores: bool = True,
    split_slots: int | None = None,
    block_n: int = BLOCK_N,
    return_delta: bool = True,
    num_warps: int | None = None,
    num_stages: int | None = None,
    int_tile: bool = INT_TILE,
    window_write=None,
    int_pieces: bool = INT_PIECES,
    table_ahead: int | None = TABLE_AHEAD,
    score_block: int = SCORE_BLOCK,
    half_dequant: bool = HALF_DEQUANT,
    max_registers: int | None = MAX_REGISTERS,
    column_sums: bool = COLUMN_SUMS,
    operand_fence: bool = OPERAND_FENCE,
    asm_dequant: bool = ASM_DEQUANT,
    spread_banks: bool = SPREAD_BANKS,
    code_dots: int = CODE_DOTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``query [B, Hq, q, D]`` (logical positions ``q_start ..``) over every part's slots.

    Returns ``(out [B, q, Hq, D]`` in the query dtype, ``delta [B, H, sum slots]`` fp32: the
    GQA-reduced probabilities each slot received, summed over the queries, in part order)``. With
    ``add_scores`` the deltas are also added to the parts' score sums in place; the cache needs
    only that, so it asks for no ``delta`` (None: 4 bytes per slot not written).

    The two products of the partial pass take their operands in the query's dtype: fp32 queries keep
    IEEE fp32 products (the tests' exact comparisons); bf16 / fp16 ones run on tensor cores with fp32
    accumulation, as flash attention does (the IEEE fp32 form ran at 2% of copy bandwidth on the first H200
    run): full-precision fields and probabilities in the query's dtype, integer fields dequantized in fp16
    with the query and probabilities rounded to fp16 (``half_dequant``, below). Under the interpreter,
    whose tl.dot misreads bf16 operands, bf16 queries keep the fp32 products.
    ``block_n`` / ``num_warps`` / ``num_stages`` set the partial pass's launch shape (defaults: the
    fastest measured, see ``BLOCK_N``); ``int_tile`` reads integer codes as rows (the default; a
    power-of-two ``head_dim``, else per element) or, False, per element (``load_field``), unless
    ``int_pieces`` (the default) reads them in pieces with their columns in the pieces' order
    (``load_int_pieces``); ``table_ahead`` reads the page table that many iterations before its records
    (None: as measured fastest, ``TABLE_AHEAD``); ``score_block`` is the score pass's slots per program;
    ``half_dequant`` dequantizes integer fields read in pieces to fp16 and runs their products in fp16 where
    the query is 16-bit (the default, ``HALF_DEQUANT``; False: dequantized in fp32 and rounded to the query's
    dtype, which in bf16 lies further from exact attention); ``max_registers`` caps the partial pass's registers
    per thread (Triton's ``maxnreg``, so more programs fit an SM; 0: no cap; None: ``MAX_REGISTERS``, by default
    ``INT_REGISTERS`` where integer fields are read, else ``FULL_REGISTERS``); ``column_sums`` sums the
    softmax denominators per column (``COLUMN_SUMS``); ``operand_fence`` hands the products integer tiles through an
    opaque identity (``OPERAND_FENCE``; compiled code only); ``asm_dequant`` runs the fp16 dequantization's arithmetic
    as PTX (``ASM_DEQUANT``; compiled code only); ``spread_banks`` orders integer tiles' columns for shared-memory
    stores without bank conflicts (``SPREAD_BANKS``); ``code_dots`` takes the products straight from integer codes
    (``CODE_DOTS``: 1 the keys', 2 the values', 3 both; 16-bit queries only): ``eval/kernel_variants.py`` sweeps them.

    ``window_write`` (a ring's :class:`~hfkv.storage.window.PendingWrite`: ``k, v [B, H, 1, D]``, slot,
    position) is a decode step's token that the first part, the ring, holds but has not stored: the
    partial pass stores it (keys, values, position; an empty slot's score is already 0) and attends to
    it, so the step needs no separate writes.
    """
    plan = plan_attention(
        query, parts, pad_end, reduction, add_scores, split_slots, block_n, return_delta, num_warps, num_stages,
        int_tile, window_write is not None, int_pieces, table_ahead, score_block, half_dequant, max_registers,
        column_sums, operand_fence, asm_dequant, spread_banks, code_dots,
    )  # fmt: skip
    return run_plan(plan, query, q_start, pad_end, scaling, window_write)
