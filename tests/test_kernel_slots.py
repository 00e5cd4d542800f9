"""The torch reference slot attention against dense attention over the same tokens.

Slots arrive in parts (window, tiers) in any order, with empty slots and per-head sets; the
reference concatenates the parts, builds each query's allowed set from the slot positions and the
logical mask by hand, and runs a plain softmax attention with GQA repetition.
"""

from __future__ import annotations

import pytest
import torch

from hfkv.kernels.slots import slot_attention


def _reference(query, parts, pos, mask, scaling):
    keys = torch.cat([k for k, _ in parts], 2)
    values = torch.cat([v for _, v in parts], 2)
    bsz, hq, q, d = query.shape
    hkv = keys.shape[1]
    g = hq // hkv
    keys, values, pos = (t.repeat_interleave(g, dim=1) for t in (keys, values, pos))  # transformers' repeat_kv
    logits = query @ keys.transpose(-1, -2) * scaling  # [B, Hq, q, S]
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    for b in range(bsz):
        for h in range(hq):
            for i in range(q):
                for s in range(keys.shape[2]):
                    p = int(pos[b, h, s])
                    allowed[b, h, i, s] = p >= 0 and bool(mask[b, 0, i, p])
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    return (probs @ values).transpose(1, 2), probs


@pytest.mark.parametrize("q", [1, 3])
def test_slot_attention_equals_dense_attention_over_the_same_slots(q):
    gen = torch.Generator().manual_seed(q)
    bsz, hq, hkv, d, length = 2, 4, 2, 8, 30
    sizes = (5, 9, 7)
    parts, positions = [], []
    for n in sizes:
        parts.append((torch.randn(bsz, hkv, n, d, generator=gen), torch.randn(bsz, hkv, n, d, generator=gen)))
        pos = torch.randint(0, length - q, (bsz, hkv, n), generator=gen)
        pos[torch.rand(bsz, hkv, n, generator=gen) < 0.2] = -1  # empty slots
        positions.append(pos)
    pos = torch.cat(positions, -1)
    query = torch.randn(bsz, hq, q, d, generator=gen)
    qpos = torch.arange(length - q, length)
    mask = (torch.arange(length).view(1, -1) <= qpos.view(-1, 1)).expand(bsz, 1, q, length).clone()
    mask[0, :, :, :4] = False  # left padding of row 0
    if q > 1:
        mask[1, :, 0, :] = False  # a padding query that sees nothing: zeros, not NaN
    out, probs = slot_attention(query, parts, pos + 1, mask, 0.3)
    ref_out, ref_probs = _reference(query, parts, pos, mask, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs.reshape(ref_probs.shape), ref_probs, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("q,sizes", [(1, (5, 9, 7)), (6, (5, 9, 7)), (6, (13,))])
def test_plain_causal_from_positions_equals_the_materialised_mask(q, sizes):
    """Without a mask, the causal mask of queries at ``q_start ..`` is compared from the slots' positions:
    the same attention as the materialised mask gathered per slot (one part too: its logits are not copied)."""
    gen = torch.Generator().manual_seed(7 + q)
    bsz, hq, hkv, d, length = 2, 4, 2, 8, 30
    parts, positions = [], []
    for n in sizes:
        parts.append((torch.randn(bsz, hkv, n, d, generator=gen), torch.randn(bsz, hkv, n, d, generator=gen)))
        pos = torch.randint(0, length, (bsz, hkv, n), generator=gen)  # some after the first query: hidden
        pos[torch.rand(bsz, hkv, n, generator=gen) < 0.2] = -1  # empty slots
        positions.append(pos)
    pos = torch.cat(positions, -1)
    pos[..., 0] = length - q  # every query sees at least one slot
    query = torch.randn(bsz, hq, q, d, generator=gen)
    qpos = torch.arange(length - q, length)
    mask = (torch.arange(length).view(1, -1) <= qpos.view(-1, 1)).expand(bsz, 1, q, length)
    out, probs = slot_attention(query, parts, pos + 1, None, 0.3, q_start=length - q)
    ref_out, ref_probs = slot_attention(query, parts, pos + 1, mask, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(probs, ref_probs, rtol=0, atol=0)
    with pytest.raises(ValueError, match="q_start"):
        slot_attention(query, parts, pos + 1, None, 0.3)
