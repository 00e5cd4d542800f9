"""Byte formats for one token of one KV head: full precision, group-wise integer, or fp8.

Every format turns ``[..., head_dim]`` floats into ``[..., nbytes]`` ``uint8`` and back, so the
paged storage can keep all tiers in one byte pool (DiffKV's unified pages) and the byte size of
a token is an exact property of its format rather than an estimate.

Integer formats (DiffKV / KIVI style): per group of ``group_size`` elements of one token and head,
``scale = (max - min) / (2^b - 1)`` and ``zero = min``, both stored as fp16 after the packed
codes. Codes are computed against the *stored* (fp16-rounded) scale and zero, and the scale is
rounded up, so the round-trip error stays within ``scale / 2`` plus fp16 rounding of ``zero``.
Codes are packed little-end first: element ``i`` of a byte occupies bits ``[i*b, (i+1)*b)``.

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


def _view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.view(dtype)`` for a byte slice whose storage offset may not be aligned to ``dtype``."""
    t = t.contiguous()
    if t.storage_offset() % torch.empty((), dtype=dtype).element_size():
        t = t.clone()  # a fresh storage starts aligned
    return t.view(dtype)


def _check_finite(x: torch.Tensor, what: str) -> None:
    # A NaN/Inf would silently poison the shared group scale of 31 neighbours; fail loudly instead.
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what}: cannot quantize non-finite values (NaN or Inf found in input)")


_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _code_table(bits: int, device: torch.device) -> torch.Tensor:
    """``[256, 8 // bits]`` fp32: the codes packed in each byte value, little end first."""
    key = (bits, torch.device(device))
    if key not in _TABLES:
        per = 8 // bits
        byte = torch.arange(256, dtype=torch.int32).unsqueeze(-1)
        shifts = torch.arange(per, dtype=torch.int32) * bits
        _TABLES[key] = ((byte >> shifts) & ((1 << bits) - 1)).float().to(device)
    return _TABLES[key]


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
            _check_finite(x, f"QuantFormat({self.name}).encode")
        if self.name == "fp8":
            return self._encode_fp8(x)
        return self._encode_int(x, check_finite)

    def _encode_fp8(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        amax = xf.abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        codes = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.cat([codes, scale.contiguous().view(torch.uint8)], dim=-1)

    def _encode_int(self, x: torch.Tensor, check_finite: bool = True) -> torch.Tensor:
        b = self.bits
        qmax = (1 << b) - 1
        lead = x.shape[:-1]
        xg = x.float().reshape(*lead, self.groups, self.group_size)
        mn = xg.amin(-1, keepdim=True)
        mx = xg.amax(-1, keepdim=True)
        if check_finite and bool((mx.abs() > _FP16_MAX).any() | (mn.abs() > _FP16_MAX).any()):
            raise ValueError(f"QuantFormat({self.name}).encode: values beyond fp16 range cannot be quantized")
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
        c = codes.reshape(*codes.shape[:-1], self.head_dim // per, per).to(torch.int32)
        shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * b
        return (c << shifts).sum(-1).to(torch.uint8)

    # ------------------------------------------------------------------ decode
    def decode(self, data: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[..., nbytes]`` uint8 -> ``[..., head_dim]`` in ``dtype`` (default: model dtype)."""
        dtype = dtype or self.model_dtype
        if data.shape[-1] != self.nbytes:
            raise ValueError(f"QuantFormat.decode: last dim {data.shape[-1]} != nbytes {self.nbytes}")
        if self.name == "model":
            return _view(data.contiguous(), self.model_dtype).to(dtype)
        d = self.head_dim
        if self.name == "fp8":
            codes = _view(data[..., :d], torch.float8_e4m3fn).float()
            scale = _view(data[..., d:], torch.float32)
            return (codes * scale).to(dtype)
        nb = d * self.bits // 8
        lead = data.shape[:-1]
        g = self.groups
        # One table lookup per byte yields its 8/b codes as floats (fewer ops than shift + mask + cast).
        codes = torch.nn.functional.embedding(data[..., :nb].int(), _code_table(self.bits, data.device))
        meta = _view(data[..., nb:], torch.float16).float()
        x = torch.addcmul(meta[..., g:, None], codes.view(*lead, g, self.group_size), meta[..., :g, None])
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
