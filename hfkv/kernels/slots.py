"""Attention of new queries over stored slots (torch reference backend).

Slots come from the window ring and the paged tiers, each with its logical position, so the
causal/padding mask built by transformers in logical coordinates is gathered per slot instead
of being sliced: that is what lets every (row, head) hold a different set of tokens.
One joint softmax over all slots of a head, computed in fp32. Keys and values of the parts are
never concatenated (that would copy the whole cache every step); only the small logits are.
The probabilities are returned because they are the decode-time significance scores
(docs/architecture.md, "Life of a token"), a by-product rather than a second pass.

This runs once per layer per decode step, so it is written in as few tensor operations as the
math allows: on CPU each operation costs microseconds of dispatch regardless of its size.

A part's keys or values may also come factored (:class:`~hfkv.quant.formats.ChunkCodes`: uint8
codes in chunks of the head dim, one scale and zero per chunk), which is how the integer tiers
arrive: ``q . k`` is then per-chunk ``q_c . codes_c`` scaled and summed over chunks plus
``zero_c`` times the sum of ``q_c``, and the output is per-chunk ``(p * scale_c) @ codes_c`` plus
``p @ zero_c``. Scale and zero are applied at the size of the logits and the output (a few values
per slot) instead of in passes over the tier, and the codes are converted to fp32 one chunk at a
time right before their matmul: the fp32 copy of a whole tier outgrows the CPU caches, so it is
written to memory and read back, while a chunk's copy is smaller by the number of chunks, is
read back while still cached, and its buffer is recycled for the next chunk. The results equal
the dequantized attention up to fp32 rounding.

That pays only while the query rows are few: the factored output scales the probabilities once per
chunk (``rows x slots x chunks`` products) where dequantizing costs a few passes over
``slots x head_dim``. A decode step has ``g`` rows per KV head; a prefill chunk has ``g`` times its
length, and there the factored path would multiply a chunk of 1,024 queries' probabilities by every
chunk's scale (up to 3x slower chunked prefill at 8k). So a part is dequantized first (exactly as ``decode`` does)
when ``rows x chunks`` exceeds the head dimension (:func:`factored_pays`).

A long chunk's queries are taken in tiles (:func:`slot_attention_received`): its logits are ``rows x
slots`` fp32 per KV head (200 MB for 1,024 queries of a 4-way group over 6,000 slots), and a tensor that
large comes from the OS as fresh pages at every allocation (the allocator returns it on free), so the
few full-size intermediates of one softmax cost more in page faults than the matmuls themselves. Tiles
of at most ``TILE_BYTES`` of logits are reused from the heap. The scores only need each slot's
probability reduced over the group and summed over the queries, so no tile's probabilities outlive it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hfkv.policy.scores import reduce_gqa
from hfkv.quant.formats import ChunkCodes, chunks_to_natural

KVPart = tuple[torch.Tensor | ChunkCodes, torch.Tensor | ChunkCodes]  # keys, values [B, Hkv, S_i, D]
TILE_BYTES = 4 << 20  # fp32 logits of one query tile (module doc; 2-4 MiB were fastest, 4k prompt, 1k chunks)


def _dense(t: torch.Tensor | ChunkCodes) -> torch.Tensor:
    return t.codes if isinstance(t, ChunkCodes) else t  # [B, Hkv, S, D] or [k, B, Hkv, S, D / k]


def factored_pays(rows: int, chunks: int, head_dim: int) -> bool:
    """Whether attention of ``rows`` query rows per KV head should contract codes chunk by chunk (module doc)."""
    return rows * chunks <= head_dim


def _for_rows(t: torch.Tensor | ChunkCodes, rows: int) -> torch.Tensor | ChunkCodes:
    """``t`` as the attention of ``rows`` query rows takes it: factored, or fp32 values in natural order."""
    if not isinstance(t, ChunkCodes):
        return t
    k, n = t.codes.shape[0], t.codes.shape[-1]
    return t if factored_pays(rows, k, k * n) else chunks_to_natural(t.dequantize(), torch.float32)


def _logits(qf: torch.Tensor, keys: torch.Tensor | ChunkCodes) -> torch.Tensor:
    """``qf [B, Hkv, r, D] @ keys^T`` -> ``[B, Hkv, r, S]``."""
    if not isinstance(keys, ChunkCodes):
        return torch.matmul(qf, keys.float().transpose(-1, -2))
    codes = keys.codes
    qc = qf.unflatten(-1, (codes.shape[0], -1)).movedim(-2, 0).contiguous()  # [k, B, Hkv, r, D / k]
    # A loop over chunks of the head dim (module doc); ``out=`` would refuse a query that needs grad.
    logits = torch.stack([torch.matmul(qc[c], codes[c].float().transpose(-1, -2)) for c in range(len(codes))])
    logits = logits.mul_(keys.scale.unsqueeze(-2)).sum(0)
    return logits.add_(torch.matmul(qc.sum(-1).movedim(0, -1), keys.zero.movedim(0, -2)))


def _weighted(probs: torch.Tensor, values: torch.Tensor | ChunkCodes) -> torch.Tensor:
    """``probs [B, Hkv, r, S] @ values`` -> ``[B, Hkv, r, D]``."""
    if not isinstance(values, ChunkCodes):
        return torch.matmul(probs, values.float())
    codes = values.codes
    weights = probs * values.scale.unsqueeze(-2)  # [k, B, Hkv, r, S]
    out = torch.stack([torch.matmul(weights[c], codes[c].float()) for c in range(len(codes))], -2)
    zero = torch.matmul(probs, values.zero.movedim(0, -1))  # [B, Hkv, r, k]
    return out.add_(zero.unsqueeze(-1)).flatten(-2)  # [B, Hkv, r, k, D / k] -> [B, Hkv, r, D]


def slot_attention(
    query: torch.Tensor,
    parts: Sequence[KVPart],
    slot_index: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    blind_queries: bool | None = None,
    q_start: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over per-head slot sets split in parts (window, tiers).

    query ``[B, Hq, q, D]``; each part ``(keys [B, Hkv, S_i, D], values)``, either possibly
    factored (module doc); ``slot_index [B, Hkv, sum S_i]``
    int64 is each slot's logical position + 1, with 0 for an empty slot (whose keys and values must
    be finite); mask ``[B, 1, q, L]`` bool in logical coordinates, or None for the plain causal mask of
    queries at positions ``q_start ..`` (no padding: compared from the slots' positions, not gathered).
    Returns ``(out [B, q, Hq, D] in query dtype, probs [B, Hkv, g, q, sum S_i] fp32)``. ``blind_queries``:
    whether a query may see no slot at all (a chunk's padding query; default: ``q > 1`` with a mask, never
    without), which gives zeros, not NaN.
    """
    bsz, hq, q, d = query.shape
    hkv = _dense(parts[0][0]).shape[-3]
    g = hq // hkv
    qf = query.reshape(bsz, hkv, g * q, d).float() * scaling
    parts = [(_for_rows(keys, g * q), _for_rows(values, g * q)) for keys, values in parts]
    # (one part: its logits as they are; a one-tensor cat would copy them)
    logits = _logits(qf, parts[0][0]) if len(parts) == 1 else torch.cat([_logits(qf, k) for k, _ in parts], -1)
    s = slot_index.shape[-1]
    if mask is None:
        if q_start is None:
            raise ValueError("slot_attention: without a mask, q_start (the first query's position) is needed")
        # Empty slots (index 0) sort after every query; a slot is seen by the queries at or after it.
        key = torch.where(slot_index > 0, slot_index - 1, torch.iinfo(slot_index.dtype).max)
        allowed = key.unsqueeze(2) <= torch.arange(q_start, q_start + q, device=key.device).view(1, 1, q, 1)
        blind = bool(blind_queries)
    else:
        # Column 0 of the padded mask is False: empty slots (index 0) are never attended.
        m = F.pad(mask[:, 0].to(torch.bool), (1, 0), value=False)  # [B, q, L + 1]
        allowed = torch.gather(
            m.unsqueeze(1).expand(bsz, hkv, q, -1), 3, slot_index.unsqueeze(2).expand(bsz, hkv, q, s)
        )
        blind = q > 1 if blind_queries is None else blind_queries
    # (where, not an in-place masked_fill_: with the mask broadcast over the group that is 2x slower on CPU)
    logits = torch.where(allowed.unsqueeze(2), logits.view(bsz, hkv, g, q, s), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if blind:  # a chunk's padding query: zeros, not NaN
        probs = probs.nan_to_num_(0.0)
    flat = probs.view(bsz, hkv, g * q, s)
    out, start = None, 0
    for _, values in parts:
        n = _dense(values).shape[-2]
        o = _weighted(flat[..., start : start + n], values)
        out = o if out is None else out.add_(o)
        start += n
    return out.view(bsz, hq, q, d).transpose(1, 2).to(query.dtype), probs


def slot_attention_received(
    query: torch.Tensor,
    parts: Sequence[KVPart],
    slot_index: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    reduction: str,
    tile_bytes: int = TILE_BYTES,
    q_start: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`slot_attention` with the scores instead of the probabilities, in tiles of queries (module doc).
    ``mask`` None: the plain causal mask of queries at positions ``q_start ..`` (as :func:`slot_attention`).

    Returns ``(out [B, q, Hq, D], received [B, Hkv, sum S_i])``: each slot's probability reduced over its
    GQA group (``reduction``, :func:`hfkv.policy.scores.reduce_gqa`) and summed over the queries.
    """
    bsz, hq, q, _ = query.shape
    hkv = _dense(parts[0][0]).shape[-3]
    g, s = hq // hkv, slot_index.shape[-1]
    tile = max(1, min(q, tile_bytes // max(1, 4 * bsz * hkv * g * s)))
    if tile < q:  # dequantize once for every tile, as the tiles' rows would
        parts = [(_for_rows(keys, g * tile), _for_rows(values, g * tile)) for keys, values in parts]
        if not any(isinstance(x, ChunkCodes) for part in parts for x in part):
            # One part: fp32 keys and values of every slot are small beside a tile's logits, and one matmul
            # per tile replaces a matmul per part, the concatenated logits and strided probability slices.
            parts = [tuple(torch.cat([x.float() for x in xs], -2) for xs in zip(*parts, strict=True))]
    outs, received = [], None
    for t0 in range(0, q, tile):
        rows = slice(t0, t0 + tile)
        if mask is None:  # plain causal from q_start (slot_attention)
            out, probs = slot_attention(query[:, :, rows], parts, slot_index, None, scaling, False, q_start + t0)
        else:
            out, probs = slot_attention(query[:, :, rows], parts, slot_index, mask[:, :, rows], scaling, q > 1)
        got = reduce_gqa(probs.flatten(1, 2), hkv, reduction).sum(2)
        received = got if received is None else received.add_(got)
        outs.append(out)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)), received
