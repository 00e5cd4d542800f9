"""Byte formats for one token of one KV head: full precision, group-wise integer, or fp8.

Every format turns ``[..., head_dim]`` floats into ``[..., nbytes]`` ``uint8`` and back, so the
paged storage can keep all tiers in one byte pool (DiffKV's unified pages) and the byte size of
a token is an exact property of its format rather than an estimate.

Integer formats (DiffKV / KIVI style): per group of ``group_size`` elements of one token and head,
``scale = (max - min) / (2^b - 1)`` and ``zero = min``, both stored as fp16 after the packed
codes. Codes are computed against the *stored* (fp16-rounded) scale and zero, and the scale is
rounded up, so the round-trip error stays within ``scale / 2`` plus fp16 rounding of ``zero``.
Codes are packed in planes, little end first: with ``per = 8 / b`` codes per byte and
``P = head_dim / per``, byte ``j`` holds elements ``j, j + P, .., j + (per-1)P`` and element
``j + pP`` occupies bits ``[p*b, (p+1)*b)``. Unpacking then is one mask or shift per plane over
contiguous bytes, each plane a contiguous run of elements — no interleaving copy on the decode
path, which runs every step (KIVI and the DiffKV kernels pack the same way for the same reason).

The torch decode step never builds a dequantized tier in natural order. A field is read as
:class:`ChunkCodes`: the codes in *chunk order*, ``[k, ..., head_dim / k]`` with ``codes[c, ..., j]``
the element ``c * head_dim / k + j``, where a chunk is the longest run of elements inside one byte
plane and one group (``gcd(P, group_size)`` elements), and one scale and one zero per chunk. On
CPU an elementwise op costs per contiguous row once rows are short, and a pass over a tier
costs memory traffic: in chunk order the shift and mask run on 8-byte words over whole chunks
with no interleave (natural order needs one over rows of ``P`` elements, as costly as the rest
of the decode), the codes stay uint8 until attention converts one chunk at a time, and scale
and zero are applied at the size of the logits and outputs
(:func:`hfkv.kernels.slots.slot_attention`) instead of in passes over the tier.
:meth:`QuantFormat.decode_at` dequantizes with the formula it always used (``code`` to fp32,
``* scale``, then ``+ zero``) and interleaves once, for callers that want values.

fp8 (ARKV's tier): e4m3 codes with one fp32 scale per token and head (``amax / 448``); fp32
because an fp16 scale underflows for small-magnitude heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache
from typing import NamedTuple

import torch

FORMAT_NAMES = ("model", "int8", "int4", "int2", "fp8")
INT_BITS = {"int8": 8, "int4": 4, "int2": 2}
FP8_MAX = 448.0
_FP16_MAX = 65504.0


def aligned_records(rec: torch.Tensor) -> torch.Tensor:
    """``rec [..., R]`` uint8 as a tensor whose rows can be viewed as 2- and 4-byte words.

    That needs a contiguous last dim, ``R`` a multiple of 4 and a 4-aligned start; gathered
    pages already are, anything else (a single record, an odd-sized field) is copied once.
    """
    r = rec.shape[-1]
    if (
        rec.stride(-1) == 1
        and r % 4 == 0
        and not torch.compiler.is_compiling()  # Dynamo cannot trace storage_offset(): the copy below is exact too
        and rec.storage_offset() % 4 == 0
        and all(st % 4 == 0 for st in rec.stride()[:-1])
    ):
        return rec
    out = torch.zeros(*rec.shape[:-1], (r + 3) // 4 * 4, dtype=torch.uint8, device=rec.device)
    out[..., :r] = rec
    return out


# Widest integer word first: copying a field and shifting its codes cost per element on CPU, so
# 8 bytes per element does an eighth of the work of bytes.
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _word(t: torch.Tensor, start: int, n: int) -> tuple[int, torch.dtype]:
    """Widest word that can view bytes ``[start, start + n)`` of every row of the uint8 ``t`` (bytes under Dynamo,
    which cannot trace ``storage_offset()``)."""
    if torch.compiler.is_compiling():
        return _WORDS[-1]
    for w, dt in _WORDS[:-1]:
        if (
            start % w == 0
            and n % w == 0
            and t.shape[-1] % w == 0
            and t.stride(-1) == 1
            and t.storage_offset() % w == 0
            and all(st % w == 0 for st in t.stride()[:-1])
        ):
            return w, dt
    return _WORDS[-1]


def _read_field(rec: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Bytes ``[start, start + n)`` of every record of ``rec [..., R]`` as a new contiguous uint8 tensor.

    A strided operand with short rows is the slow path of every elementwise op, while a copy of
    whole rows is not: one copy up front (through the widest word view the alignment allows) makes
    every later op of the decode run on contiguous memory, at any offset and alignment.
    """
    w, dt = _word(rec, start, n)
    field = rec.view(dt)[..., start // w : (start + n) // w] if w > 1 else rec[..., start : start + n]
    return field.clone(memory_format=torch.contiguous_format).view(torch.uint8)


@cache
def _plane_shifts(bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # A constant per bit width and word type (not cache state): one broadcast shift unpacks all planes.
    return torch.arange(0, 8, bits, dtype=dtype, device=device)


def _byte_mask(bits: int, width: int) -> int:
    """The byte ``2**bits - 1`` repeated ``width`` times, as a signed ``width``-byte integer (arithmetic, not
    ``int.from_bytes``: Dynamo traces this)."""
    value = sum(((1 << bits) - 1) << (8 * i) for i in range(width))
    return value - (1 << 8 * width) if value >> (8 * width - 1) else value


class ChunkCodes(NamedTuple):
    """An integer field left factored, in chunk order: ``value = code * scale + zero`` per chunk.

    ``codes [k, ..., n]`` uint8, ``scale`` and ``zero [k, ...]`` fp32 (module doc). Kept apart
    so that attention can contract the codes chunk by chunk and apply scale and zero to its much
    smaller logits and outputs; :meth:`dequantize` gives the values, bit-identical to ``decode``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """fp32 values in chunk order ``[k, ..., n]``."""
        return self.codes.float().mul_(self.scale.unsqueeze(-1)).add_(self.zero.unsqueeze(-1))


def chunks_to_natural(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Chunk order ``[k, ..., D / k]`` to natural order ``[..., D]`` in ``dtype``, in one copy."""
    k, n = x.shape[0], x.shape[-1]
    if k == 1:
        return x[0].to(dtype)
    lead = x.shape[1:-1]
    out = torch.empty(*lead, k, n, dtype=dtype, device=x.device)
    out.copy_(x.movedim(0, -2))
    return out.view(*lead, k * n)


def check_encodable_all(fields: list[tuple[QuantFormat, torch.Tensor]]) -> None:
    """Raise where quantizing a field's values would silently corrupt a group: a NaN/Inf poisons the shared
    scale of its neighbours, and an integer format keeps its scale and zero in fp16.

    One ``aminmax`` per field and one host read for all of them: a prompt's check was four full passes
    (isfinite, float copy, abs, compare) and a host wait per field, on every tier it fills.
    """
    check_ends(*encodable_ends(fields))


def encodable_ends(fields: list[tuple[QuantFormat, torch.Tensor]]) -> tuple[list[QuantFormat], torch.Tensor | None]:
    """The quantized fields' formats and their values' ends ``[n, 2]`` on the device, for :func:`check_ends` to read
    once after several calls' worth (a prompt's tiers are checked with one host wait, not one per tier)."""
    fields = [(f, x) for f, x in fields if f.name != "model" and x.numel()]
    if not fields:
        return [], None
    return [f for f, _ in fields], torch.stack([torch.stack(torch.aminmax(x)).float() for _, x in fields])


def check_ends(formats: list[QuantFormat], ends: torch.Tensor | None) -> None:
    """Raise as :func:`check_encodable_all` does, from :func:`encodable_ends` (one host read)."""
    if ends is None:
        return
    for fmt, (lo, hi) in zip(formats, ends.tolist(), strict=True):
        what = f"QuantFormat({fmt.name}).encode"
        if not (math.isfinite(lo) and math.isfinite(hi)):  # aminmax propagates NaN; Inf is an end
            raise ValueError(f"{what}: cannot quantize non-finite values (NaN or Inf found in input)")
        if fmt.name in INT_BITS and max(-lo, hi) > _FP16_MAX:
            raise ValueError(f"{what}: values beyond fp16 range cannot be quantized")


@dataclass(frozen=True)
class QuantFormat:
    """One tier format for keys or values of one layer.

    ``model_dtype`` is the dtype full-precision tokens are kept in and the dtype ``decode``
    returns by default.
    """

    name: str
    head_dim: int
    group_size: int = 32
    model_dtype: torch.dtype = torch.float16
    # Set once from the above (plain fields, not cached_property: its lock stops Dynamo tracing a decode step)
    bits: int = field(init=False, repr=False, compare=False)
    groups: int = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)  # exact bytes per token per head
    chunk: int = field(init=False, repr=False, compare=False)  # elements per chunk of chunk_codes_at

    def __post_init__(self) -> None:
        if self.name not in FORMAT_NAMES:
            raise ValueError(f"QuantFormat.name={self.name!r} is not a known format; allowed: {FORMAT_NAMES}")
        if not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ValueError(f"QuantFormat.head_dim={self.head_dim!r} must be a positive int")
        if self.name in INT_BITS:
            g = self.group_size
            if not isinstance(g, int) or g <= 0 or self.head_dim % g:
                raise ValueError(
                    f"QuantFormat.group_size={g!r} must be a positive divisor of head_dim={self.head_dim} "
                    f"for format {self.name!r}"
                )
            per_byte = 8 // INT_BITS[self.name]
            if g % per_byte:
                raise ValueError(
                    f"QuantFormat.group_size={g} must be a multiple of {per_byte} for {self.name!r} "
                    "(whole bytes per group)"
                )
        for name, value in zip(("bits", "groups", "nbytes"), self._sizes(), strict=True):
            object.__setattr__(self, name, value)
        # Elements per chunk of chunk_codes_at (head_dim for unpacked formats). A field, not a property: under
        # torch.compile(dynamic=True) the ints are symbolic and math.gcd cannot take them.
        chunk = math.gcd(self.head_dim * self.bits // 8, self.group_size) if self.name in INT_BITS else self.head_dim
        object.__setattr__(self, "chunk", chunk)

    def _sizes(self) -> tuple[int, int, int]:
        """bits, groups, and the exact bytes per token per head (scales and zeros included)."""
        if self.name == "model":
            size = torch.empty((), dtype=self.model_dtype).element_size()
            return 8 * size, 1, self.head_dim * size
        bits, groups = INT_BITS.get(self.name, 8), self.head_dim // self.group_size if self.name in INT_BITS else 1
        return bits, groups, self.head_dim + 4 if self.name == "fp8" else self.head_dim * bits // 8 + 4 * groups

    # ------------------------------------------------------------------ encode
    def encode(self, x: torch.Tensor, check_finite: bool = True) -> torch.Tensor:
        """``[..., head_dim]`` floats -> ``[..., nbytes]`` uint8."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"QuantFormat.encode: last dim {x.shape[-1]} != head_dim {self.head_dim}")
        if self.name == "model":
            return x.to(self.model_dtype).contiguous().view(torch.uint8)
        if check_finite:
            self.check_encodable(x)
        if self.name == "fp8":
            return self._encode_fp8(x)
        return self._encode_int(x)

    def check_encodable(self, x: torch.Tensor) -> None:
        """Raise where quantizing ``x`` would silently corrupt a group (NaN/Inf, beyond fp16 range)."""
        check_encodable_all([(self, x)])

    def _encode_fp8(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        amax = xf.abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        codes = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.cat([codes, scale.contiguous().view(torch.uint8)], dim=-1)

    def _encode_int(self, x: torch.Tensor) -> torch.Tensor:
        b = self.bits
        qmax = (1 << b) - 1
        lead = x.shape[:-1]
        xg = x.float().reshape(*lead, self.groups, self.group_size)
        mn = xg.amin(-1, keepdim=True)
        mx = xg.amax(-1, keepdim=True)
        zero16 = mn.to(torch.float16)
        # Guard max == min: a constant group gets scale 0 and decodes exactly to fp16(min), even when
        # fp16 rounding put zero16 below min (which would otherwise give a tiny non-zero scale).
        scale = torch.where(mx > mn, (mx - zero16.float()) / qmax, 0.0)
        scale16 = scale.to(torch.float16)
        # Round the stored scale up so the top code still reaches max after fp16 rounding.
        too_small = scale16.float() < scale
        scale16 = torch.where(too_small, torch.nextafter(scale16, torch.full_like(scale16, torch.inf)), scale16)
        s = scale16.float()
        codes = torch.where(s > 0, torch.round((xg - zero16.float()) / torch.where(s > 0, s, 1.0)), 0.0)
        codes = codes.clamp_(0, qmax).to(torch.uint8).reshape(*lead, self.head_dim)
        packed = self._pack(codes)
        meta = torch.cat([scale16.reshape(*lead, self.groups), zero16.reshape(*lead, self.groups)], dim=-1)
        return torch.cat([packed, meta.contiguous().view(torch.uint8)], dim=-1)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        b = self.bits
        per = 8 // b
        if per == 1:
            return codes
        planes = codes.reshape(*codes.shape[:-1], per, self.head_dim // per).to(torch.int32)
        shifts = (torch.arange(per, device=codes.device, dtype=torch.int32) * b).unsqueeze(-1)
        return (planes << shifts).sum(-2).to(torch.uint8)

    # ------------------------------------------------------------------ decode

    def decode(self, data: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[..., nbytes]`` uint8 -> ``[..., head_dim]`` in ``dtype`` (default: model dtype)."""
        if data.shape[-1] != self.nbytes:
            raise ValueError(f"QuantFormat.decode: last dim {data.shape[-1]} != nbytes {self.nbytes}")
        return self.decode_at(data if self.name in INT_BITS else aligned_records(data), 0, dtype)

    def aligned_at(self, offset: int) -> bool:
        """Whether a field at byte ``offset`` of a 4-aligned record can be read by :meth:`decode_at`.

        Integer fields are copied out of the records (:meth:`chunk_codes_at`), so any offset works.
        """
        if self.name == "model":
            return offset % (self.bits // 8) == 0
        if self.name == "fp8":
            return (offset + self.head_dim) % 4 == 0
        return True

    def decode_at(self, rec: torch.Tensor, offset: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Decode the field at byte ``offset`` of every record in ``rec [..., R]``.

        Records arrive as one byte tensor (the decode step reads whole pages), so each field is
        read where it lies: full precision and fp8 through dtype views, which needs ``rec`` to
        satisfy :func:`aligned_records` and the field :meth:`aligned_at` ``offset``; integer
        fields through :meth:`chunk_codes_at`, at any offset.
        """
        dtype = dtype or self.model_dtype
        d = self.head_dim
        if self.name == "model":
            start = offset // (self.bits // 8)
            return rec.view(self.model_dtype)[..., start : start + d].to(dtype)
        if self.name == "fp8":
            codes = rec[..., offset : offset + d].view(torch.float8_e4m3fn).float()
            scale = rec.view(torch.float32)[..., (offset + d) // 4, None]
            return (codes * scale).to(dtype)
        return chunks_to_natural(self.chunk_codes_at(rec, offset).dequantize(), dtype)

    def chunk_codes_at(self, rec: torch.Tensor, offset: int) -> ChunkCodes:
        """The integer field at byte ``offset`` of every record in ``rec [..., R]``, left factored.

        Reads any offset and alignment: the codes are copied out of the records first, whole rows
        at a time (through the widest word view that fits), because every later op then runs on
        contiguous memory, where a strided operand with short rows is the slow path of every op.
        """
        if self.name not in INT_BITS:
            raise ValueError(f"QuantFormat.chunk_codes_at: {self.name!r} is not an integer format")
        b, g, gs, n = self.bits, self.groups, self.group_size, self.chunk
        per = 8 // b
        p = self.head_dim // per  # bytes of codes == elements per plane
        c, k = p // n, self.head_dim // n  # chunks per plane, in all
        lead = rec.shape[:-1]
        # Packed bytes chunk by chunk, [c, *lead, n]: byte j of chunk t holds element t*n + j of every plane.
        w, dt = _word(rec, offset, n)  # a word never straddles two chunks
        words = rec.view(dt)[..., offset // w : (offset + p) // w] if w > 1 else rec[..., offset : offset + p]
        codes = words.unflatten(-1, (c, n // w)).movedim(-2, 0).clone(memory_format=torch.contiguous_format)
        if per > 1:
            # All planes in one shift (broadcast over a leading plane dim) and one mask on words:
            # a byte's plane lands in place, so chunk ``(plane, t)`` stays a contiguous run.
            plane_shifts = _plane_shifts.__wrapped__ if torch.compiler.is_compiling() else _plane_shifts  # no lru
            shifts = plane_shifts(b, dt, rec.device).view(per, *(1,) * codes.dim())  # cache in a traced step
            codes = (codes >> shifts).bitwise_and_(_byte_mask(b, w))
        codes = codes.view(torch.uint8).view(k, *lead, n)
        # Scales and zeros as rows [2, k, *lead] in one transposing read of the small fp16 field
        # (a group spans ``gs / n`` consecutive chunks), so that each broadcasts one value over a
        # chunk of contiguous codes. fp16 -> fp32 is exact.
        meta = _read_field(rec, offset + p, 4 * g).view(torch.float16).view(*lead, 2, g, 1)
        sz = meta.expand(*lead, 2, g, gs // n).movedim((-3, -2, -1), (0, 1, 2))
        sz = sz.to(torch.float32, memory_format=torch.contiguous_format).view(2, k, *lead)
        return ChunkCodes(codes, sz[0], sz[1])

    def max_abs_error(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element worst-case round-trip error of this format for ``x`` (for tests and docs)."""
        if self.name == "model":
            return torch.zeros_like(x, dtype=torch.float32)
        xf = x.float()
        if self.name == "fp8":
            # e4m3 has 3 mantissa bits: relative error <= 2^-4, plus the subnormal step near zero.
            scale = xf.abs().amax(-1, keepdim=True) / FP8_MAX
            return xf.abs() * 2.0**-4 + scale * 2.0**-9
        lead = x.shape[:-1]
        xg = xf.reshape(*lead, self.groups, self.group_size)
        mn, mx = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
        scale = (mx - mn) / ((1 << self.bits) - 1)
        fp16_slack = (mn.abs() + mx.abs()) * 2.0**-10
        bound = scale / 2 * (1 + 2.0**-9) + fp16_slack
        return bound.expand_as(xg).reshape(x.shape)
