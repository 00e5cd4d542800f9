"""Attention of new queries over stored slots (torch reference backend).

Slots come from the window ring and the paged tiers, each with its logical position, so the
causal/padding mask built by transformers in logical coordinates is gathered per slot instead
of being sliced: that is what lets every (row, head) hold a different set of tokens.
One joint softmax over all slots of a head, computed in fp32. Keys and values of the parts are
never concatenated (that would copy the whole cache every step); only the small logits are.
The probabilities are returned because they are the decode-time significance scores
(DESIGN §3), a by-product rather than a second pass.

This runs once per layer per decode step, so it is written in as few tensor operations as the
math allows: on CPU each operation costs microseconds of dispatch regardless of its size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

KVPart = tuple[torch.Tensor, torch.Tensor]  # keys, values [B, Hkv, S_i, D]


def slot_attention(
    query: torch.Tensor,
    parts: Sequence[KVPart],
    slot_index: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over per-head slot sets split in parts (window, tiers).

    query ``[B, Hq, q, D]``; each part ``(keys [B, Hkv, S_i, D], values)``; ``slot_index [B, Hkv, sum S_i]``
    int64 is each slot's logical position + 1, with 0 for an empty slot (whose keys and values must
    be finite); mask ``[B, 1, q, L]`` bool in logical coordinates. Returns
    ``(out [B, q, Hq, D] in query dtype, probs [B, Hkv, g, q, sum S_i] fp32)``.
    """
    bsz, hq, q, d = query.shape
    hkv = parts[0][0].shape[1]
    g = hq // hkv
    qf = query.reshape(bsz, hkv, g * q, d).float() * scaling
    logits = torch.cat([torch.matmul(qf, keys.float().transpose(-1, -2)) for keys, _ in parts], -1)
    # Column 0 of the padded mask is False: empty slots (index 0) are never attended.
    m = F.pad(mask[:, 0].to(torch.bool), (1, 0), value=False)  # [B, q, L + 1]
    s = slot_index.shape[-1]
    allowed = torch.gather(m.unsqueeze(1).expand(bsz, hkv, q, -1), 3, slot_index.unsqueeze(2).expand(bsz, hkv, q, s))
    logits = torch.where(allowed.unsqueeze(2), logits.view(bsz, hkv, g, q, s), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if q > 1:  # a padding query of a chunk may see no slot at all: zeros, not NaN
        probs = probs.nan_to_num_(0.0)
    flat = probs.view(bsz, hkv, g * q, s)
    out, start = None, 0
    for _, values in parts:
        n = values.shape[2]
        o = torch.matmul(flat[..., start : start + n], values.float())
        out = o if out is None else out.add_(o)
        start += n
    return out.view(bsz, hq, q, d).transpose(1, 2).to(query.dtype), probs
