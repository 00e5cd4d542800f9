"""Attention of new queries over stored slots (torch reference backend).

Slots come from the window ring and the paged tiers, each with its logical position, so the
causal/padding mask built by transformers in logical coordinates is gathered per slot instead
of being sliced: that is what lets every (row, head) hold a different set of tokens.
One joint softmax over all slots of a head, computed in fp32; the probabilities are returned
because they are the decode-time significance scores (DESIGN §3), a by-product rather than a
second pass.
"""

from __future__ import annotations

import torch


def slot_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot_pos: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over per-head slot sets.

    query ``[B, Hq, q, D]``; keys/values ``[B, Hkv, S, D]``; slot_pos ``[B, Hkv, S]`` int64 logical
    positions (``-1`` = empty slot); mask ``[B, 1, q, L]`` bool in logical coordinates (True =
    may attend). Returns ``(out [B, q, Hq, D] in query dtype, probs [B, Hkv, g, q, S] fp32)``.
    """
    bsz, hq, q, d = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    g = hq // hkv
    qf = query.float().reshape(bsz, hkv, g * q, d)
    logits = torch.matmul(qf, keys.float().transpose(-1, -2)) * scaling  # [B, Hkv, g*q, S]
    logits = logits.view(bsz, hkv, g, q, s)
    valid = slot_pos >= 0
    if mask is not None:
        m = mask[:, 0].to(torch.bool)  # [B, q, L]
        idx = slot_pos.clamp_min(0).clamp_max(m.shape[-1] - 1)  # [B, Hkv, S]
        allowed = torch.gather(
            m.unsqueeze(1).expand(bsz, hkv, q, m.shape[-1]), 3, idx.unsqueeze(2).expand(bsz, hkv, q, s)
        )  # [B, Hkv, q, S]
        allowed = allowed & valid.unsqueeze(2)
    else:
        allowed = valid.unsqueeze(2).expand(bsz, hkv, q, s)
    logits = logits.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with nothing visible (padding queries)
    out = torch.matmul(probs.view(bsz, hkv, g * q, s), values.float())  # [B, Hkv, g*q, D]
    out = out.view(bsz, hq, q, d).transpose(1, 2).to(query.dtype)
    return out, probs
