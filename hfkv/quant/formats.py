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

fp8 (ARKV's tier): e4m3 codes with one fp32 scale per token and head (``amax / 448``); fp32
because an fp16 scale underflows for small-magnitude heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

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
        and rec.storage_offset() % 4 == 0
        and all(st % 4 == 0 for st in rec.stride()[:-1])
    ):
        return rec
    out = torch.zeros(*rec.shape[:-1], (r + 3) // 4 * 4, dtype=torch.uint8, device=rec.device)
    out[..., :r] = rec
    return out


def _check_finite(x: torch.Tensor, what: str) -> None:
    # A NaN/Inf would silently poison the shared group scale of 31 neighbours; fail loudly instead.
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what}: cannot quantize non-finite values (NaN or Inf found in input)")


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

    @cached_property
    def bits(self) -> int:
        if self.name == "model":
            return 8 * torch.empty((), dtype=self.model_dtype).element_size()
        return INT_BITS.get(self.name, 8)

    @cached_property
    def groups(self) -> int:
        return self.head_dim // self.group_size if self.name in INT_BITS else 1

    @cached_property
    def nbytes(self) -> int:
        """Exact bytes per token per head, scales and zeros included."""
        if self.name == "model":
            return self.head_dim * torch.empty((), dtype=self.model_dtype).element_size()
        if self.name == "fp8":
            return self.head_dim + 4
        return self.head_dim * self.bits // 8 + 4 * self.groups

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
        if self.name == "model":
            return
        _check_finite(x, f"QuantFormat({self.name}).encode")
        if self.name in INT_BITS and bool((x.float().abs() > _FP16_MAX).any()):
            raise ValueError(f"QuantFormat({self.name}).encode: values beyond fp16 range cannot be quantized")

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
        return self.decode_at(aligned_records(data), 0, dtype)

    def aligned_at(self, offset: int) -> bool:
        """Whether a field at byte ``offset`` of a 4-aligned record can be read through dtype views."""
        if self.name == "model":
            return offset % (self.bits // 8) == 0
        if self.name == "fp8":
            return (offset + self.head_dim) % 4 == 0
        return (offset + self.head_dim * self.bits // 8) % 2 == 0

    def decode_at(self, rec: torch.Tensor, offset: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Decode the field at byte ``offset`` of every record in ``rec [..., R]`` without copying records.

        The decode step reads whole pages, so its records arrive as one byte tensor; reading each
        field through a dtype view of that tensor (instead of slicing, making contiguous and
        re-viewing) saves a copy of the tier per step. ``rec`` must satisfy :func:`aligned_records`
        and the field :meth:`aligned_at` ``offset``.
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
        b, nb, g = self.bits, d * self.bits // 8, self.groups
        lead = rec.shape[:-1]
        if b < 8:
            m = (1 << b) - 1
            if offset % 4 == 0 and nb % 4 == 0:
                # Four bytes at a time: a mask and a shift on int32 words give each byte's plane p in
                # place, so a plane is one op over a quarter of the elements (and no strided bytes).
                src, m = (
                    rec.view(torch.int32)[..., offset // 4 : (offset + nb) // 4],
                    int.from_bytes(bytes([m] * 4), "little", signed=True),
                )
            else:
                src = rec[..., offset : offset + nb].contiguous()
            codes = torch.cat([src & m, *((src >> (p * b)) & m for p in range(1, 8 // b))], -1).view(torch.uint8)
        else:
            codes = rec[..., offset : offset + nb]
        # ``float()`` of a strided fp16 slice gives a contiguous fp32 tensor: broadcasting a strided
        # operand is the slow path of elementwise ops.
        meta = rec.view(torch.float16)
        a = (offset + nb) // 2
        scale, zero = meta[..., a : a + g].float().unsqueeze(-1), meta[..., a + g : a + 2 * g].float().unsqueeze(-1)
        x = codes.view(*lead, g, self.group_size).float().mul_(scale).add_(zero)
        return x.view(*lead, d).to(dtype)

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
