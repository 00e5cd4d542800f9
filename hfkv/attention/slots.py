"""Attention of new queries over stored slots (torch reference backend).

Slots come from the window ring and the paged tiers, each with its logical position, so the
causal/padding mask built by transformers in logical coordinates is gathered per slot instead
of being sliced: that is what lets every (row, head) hold a different set of tokens.
One joint softmax over all slots of a head, computed in fp32. Keys and values of the parts are
never concatenated (that would copy the whole cache every step); only the small logits are.
The probabilities are returned because they are the decode-time significance scores
(DESIGN §3), a by-product rather than a second pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SlotPart = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # keys, values [B, Hkv, S, D]; pos [B, Hkv, S]


def _allowed(slot_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, q, S]``: may query i see slot s? Gathers the logical mask at each slot's position."""
    bsz, hkv, s = slot_pos.shape
    m = mask[:, 0].to(torch.bool)  # [B, q, L]
    q, length = m.shape[1], m.shape[2]
    idx = slot_pos.clamp(0, length - 1).unsqueeze(2).expand(bsz, hkv, q, s)
    allowed = torch.gather(m.unsqueeze(1).expand(bsz, hkv, q, length), 3, idx)
    return allowed & (slot_pos >= 0).unsqueeze(2)


def slot_attention(
    query: torch.Tensor, parts: Sequence[SlotPart], mask: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over per-head slot sets split in parts (window, tiers).

    query ``[B, Hq, q, D]``; each part ``(keys [B, Hkv, S_i, D], values, slot_pos [B, Hkv, S_i])`` with
    ``slot_pos = -1`` for empty slots (their values must be finite); mask ``[B, 1, q, L]`` bool in
    logical coordinates. Returns ``(out [B, q, Hq, D] in query dtype, probs [B, Hkv, g, q, sum S_i] fp32)``.
    """
    bsz, hq, q, d = query.shape
    hkv = parts[0][0].shape[1]
    g = hq // hkv
    qf = query.float().reshape(bsz, hkv, g * q, d) * scaling
    logits = torch.cat([torch.matmul(qf, keys.float().transpose(-1, -2)) for keys, _, _ in parts], -1)
    allowed = _allowed(torch.cat([pos for _, _, pos in parts], -1), mask)  # one gather for all parts
    logits = logits.view(bsz, hkv, g, q, -1).masked_fill_(~allowed.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # all-masked rows: padding queries
    sizes = [pos.shape[-1] for _, _, pos in parts]
    out = None
    for p, (_, values, _) in zip(torch.split(probs, sizes, -1), parts, strict=True):
        o = torch.matmul(p.reshape(bsz, hkv, g * q, -1), values.float())
        out = o if out is None else out + o
    return out.view(bsz, hq, q, d).transpose(1, 2).to(query.dtype), probs
