"""The byte record of one cached token of one KV head, and where its fields sit in a page.

A record is ``[key bytes | value bytes | pad to 4 | tag int32 | score fp32]`` where
``tag = position + 1`` and a zero tag marks an empty slot: the record as encoders make it and
readers return it (``nbytes``). Inside a page the two metadata fields are kept apart: a page of
``tpp`` records holds their bodies ``[key | value | pad]`` (``stride`` bytes each) side by side,
then their ``tpp`` tags side by side (``tag_region``), then their scores (``score_region``), so a
page costs the same ``tpp * nbytes`` bytes. Why: a decode step adds every live slot's attention to
its score; with the score inside the record that is a scattered 4-byte read-modify-write per
record, a whole 32-byte sector each way, which cost a quarter of a decode call on an H100
(docs/kernels.md), while a page's scores side by side take a sector or two. A body of only keys
and values also keeps the alignment of ``kv_bytes`` (512 for bf16 x 128: 16-byte loads), which
the 8 bytes of metadata used to break. Keeping the slot metadata in the page (rather than in side
arrays sized for the densest head) means a page's bytes are all payload of its own tier, and the
4-byte alignment lets kernels read tags and add scores in place. The tag doubles as the slot's
index into the logical mask (column 0 = never attended), so attention needs no per-slot index of
its own: the zero null page and the zeroed tails of pages read as empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hfkv.quant.formats import INT_BITS, ChunkCodes, QuantFormat, aligned_records, encodable_ends

META_BYTES = 8  # int32 tag (logical position + 1) + fp32 score sum


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


def _as_bytes(x: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    # Size-1 dims keep arbitrary strides through .contiguous(); flatten first so the byte view is legal.
    flat = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    flat.copy_(x.reshape(-1))
    return flat.view(torch.uint8).reshape(*lead, x.element_size())


@dataclass(frozen=True)
class RecordLayout:
    """Key format + value format of one tier, and where each field sits in the record."""

    key: QuantFormat
    value: QuantFormat

    # Derived sizes, set once (plain fields, not cached_property: its lock stops Dynamo tracing a decode step)
    kv_bytes: int = field(init=False, repr=False, compare=False)
    pos_offset: int = field(init=False, repr=False, compare=False)
    score_offset: int = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)  # a whole record (body + score): a page pays per slot
    stride: int = field(init=False, repr=False, compare=False)  # a record's body ([key | value | pad]): slot step

    def __post_init__(self) -> None:
        kv = self.key.nbytes + self.value.nbytes
        pos = self.body_bytes(kv)
        for name, value in (("kv_bytes", kv), ("pos_offset", pos), ("score_offset", pos + 4),
                            ("nbytes", pos + META_BYTES), ("stride", pos)):  # fmt: skip
            object.__setattr__(self, name, value)

    def body_bytes(self, kv_bytes: int) -> int:
        """A record's body for ``kv_bytes`` of key and value: 4-aligned, so its tag and score are words (a layout
        with other alignment overrides this)."""
        return _align4(kv_bytes)

    def records_per_page(self, page_bytes: int) -> int:
        return page_bytes // self.nbytes

    def tag_region(self, tpp: int) -> int:
        """Byte offset, inside a page of ``tpp`` records, of their tags (int32, one per slot, side by side)."""
        return tpp * self.stride

    def score_region(self, tpp: int) -> int:
        """Byte offset, inside a page of ``tpp`` records, of their scores (fp32, one per slot, side by side)."""
        return tpp * (self.stride + 4)

    def record_index(self, dest: torch.Tensor, page_bytes: int) -> torch.Tensor:
        """``[N, nbytes]`` int64: where each byte of a whole record lies in a flat pool of ``page_bytes`` pages,
        for slots whose bodies start at ``dest [N]`` (``pool.view(-1)[index]`` reads records as encoders make
        them; assigning to it writes them)."""
        page_at, slot = dest - dest % page_bytes, dest % page_bytes // self.stride
        tpp = self.records_per_page(page_bytes)
        meta = [page_at + self.tag_region(tpp) + 4 * slot, page_at + self.score_region(tpp) + 4 * slot]
        four = torch.arange(4, device=dest.device)
        return torch.cat(
            [dest[:, None] + torch.arange(self.stride, device=dest.device), *(m[:, None] + four for m in meta)], -1
        )

    def encode(
        self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, score: torch.Tensor, check_finite: bool = True
    ) -> torch.Tensor:
        """``k, v [..., D]``, ``pos [...]`` int, ``score [...]`` float -> ``[..., nbytes]`` uint8."""
        lead = k.shape[:-1]
        pad = self.pos_offset - self.kv_bytes
        parts = [self.key.encode(k, check_finite), self.value.encode(v, check_finite)]
        if pad:
            parts.append(torch.zeros(*lead, pad, dtype=torch.uint8, device=k.device))
        parts.append(_as_bytes(pos.to(torch.int32) + 1, lead))
        parts.append(_as_bytes(score.to(torch.float32), lead))
        return torch.cat(parts, dim=-1)

    def encodable_ends(self, k: torch.Tensor, v: torch.Tensor) -> tuple[list[QuantFormat], torch.Tensor | None]:
        """The quantized fields' formats and the ends of their values, on the device, for ``check_ends`` to read
        with other tiers' in one host wait (``hfkv.quant.formats.encodable_ends``)."""
        return encodable_ends([(self.key, k), (self.value, v)])

    def decode_kv(self, rec: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of records ``[..., nbytes]``, read in place when the records are word-aligned."""
        kb = self.key.nbytes
        rec = aligned_records(rec)
        if self.value.aligned_at(kb):
            return self.key.decode_at(rec, 0, dtype), self.value.decode_at(rec, kb, dtype)
        return self.key.decode_at(rec, 0, dtype), self.value.decode(rec[..., kb : self.kv_bytes], dtype)

    def decode_kv_for_attention(self, rec: torch.Tensor) -> tuple[torch.Tensor | ChunkCodes, torch.Tensor | ChunkCodes]:
        """Keys and values of records ``[..., nbytes]`` as the torch decode step's attention takes them.

        Integer fields stay factored (:class:`~hfkv.quant.formats.ChunkCodes`), so the step
        never pays the dequantizing passes and interleave of :meth:`decode_kv` over a whole tier;
        other fields are fp32 values, as :meth:`decode_kv` gives them.
        """

        def read(fmt: QuantFormat, offset: int) -> torch.Tensor | ChunkCodes:
            if fmt.name in INT_BITS:
                return fmt.chunk_codes_at(rec, offset)
            if fmt.aligned_at(offset):
                return fmt.decode_at(rec, offset, torch.float32)
            return fmt.decode(rec[..., offset : offset + fmt.nbytes], torch.float32)

        rec = aligned_records(rec)
        return read(self.key, 0), read(self.value, self.key.nbytes)

    def tags(self, rec: torch.Tensor) -> torch.Tensor:
        """``position + 1`` of each record (0: empty slot), int32; a view when ``rec`` is word-aligned."""
        return aligned_records(rec).view(torch.int32)[..., self.pos_offset // 4]

    def positions(self, rec: torch.Tensor) -> torch.Tensor:
        """Logical position of each record (-1: empty slot)."""
        return self.tags(rec) - 1

    def scores(self, rec: torch.Tensor) -> torch.Tensor:
        return aligned_records(rec).view(torch.float32)[..., self.score_offset // 4]
