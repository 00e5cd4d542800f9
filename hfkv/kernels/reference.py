"""The torch twin of the decode kernels (Triton and CPU), and the argument checks they share (with those of a policy
run's candidate reads).

Built on the torch backend's own reading and attention code, so every kernel is compared with the
path that defines the semantics; kept free of Triton so the CPU kernel's tests need none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hfkv.kernels.parts import DenseSlots, Part
from hfkv.kernels.slots import slot_attention
from hfkv.policy.scores import reduce_gqa

REDUCTIONS = {"max": 0, "mean": 1, "l2": 2}


def check_call(query: torch.Tensor, parts: Sequence[Part], pad_end: torch.Tensor, reduction: str) -> tuple[int, int]:
    """Raise on arguments no decode kernel accepts; return ``(KV heads, query heads per KV head)``."""
    if query.dim() != 4:
        raise ValueError(f"paged_attention: query must be [B, Hq, q, D], got shape {tuple(query.shape)}")
    if not parts:
        raise ValueError("paged_attention: parts is empty; at least the window ring is needed")
    if reduction not in REDUCTIONS:
        raise ValueError(f"paged_attention: reduction={reduction!r}; allowed: {tuple(REDUCTIONS)}")
    bsz = query.shape[0]
    if pad_end.shape != (bsz,):
        raise ValueError(f"paged_attention: pad_end must be [B]={bsz}, got shape {tuple(pad_end.shape)}")
    for i, p in enumerate(parts):
        if isinstance(p, DenseSlots):
            if p.k.shape[0] != bsz or p.k.shape[-1] != query.shape[-1] or p.k.shape != p.v.shape:
                raise ValueError(f"paged_attention: part {i} keys/values {tuple(p.k.shape)} do not match the query")
        elif p.layout.key.head_dim != query.shape[-1]:
            raise ValueError(f"paged_attention: part {i} head_dim {p.layout.key.head_dim} != {query.shape[-1]}")
    first = parts[0]
    heads = first.k.shape[1] if isinstance(first, DenseSlots) else first.table.shape[1]
    if query.shape[1] % heads:
        raise ValueError(f"paged_attention: {query.shape[1]} query heads are not a multiple of {heads} KV heads")
    return heads, query.shape[1] // heads


def _dense_of(part: Part, bsz: int, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values (fp32) and tags ``[B, H, S]`` of a part, read the way the torch backend reads it."""
    if isinstance(part, DenseSlots):
        tags = (part.pos + 1).to(torch.int32).view(1, 1, -1).expand(bsz, heads, -1)
        return part.k.float(), part.v.float(), tags
    offs = part.record_offsets()
    rec = part.pool.view(-1)[offs.unsqueeze(-1) + torch.arange(part.layout.stride, device=offs.device)]
    k, v = part.layout.decode_kv(rec, torch.float32)
    return k, v, part.pool.view(torch.int32).view(-1)[part.tag_offsets() // 4]


def paged_attention_reference(
    query: torch.Tensor,
    parts: Sequence[Part],
    q_start: int,
    pad_end: torch.Tensor,
    scaling: float,
    reduction: str = "max",
    add_scores: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`paged_attention`: the torch backend's slot attention with a positional mask."""
    heads, _ = check_call(query, parts, pad_end, reduction)
    bsz, hq, qlen, _ = query.shape
    dense = [_dense_of(p, bsz, heads) for p in parts]
    length = q_start + qlen
    col = torch.arange(length, device=query.device)
    qpos = torch.arange(q_start, length, device=query.device)
    mask = (col.view(1, 1, -1) <= qpos.view(1, -1, 1)) & (col.view(1, 1, -1) >= pad_end.view(-1, 1, 1).to(col))
    out, probs = slot_attention(
        query, [(k, v) for k, v, _ in dense], torch.cat([t for *_, t in dense], -1).long(), mask[:, None], scaling
    )
    delta = reduce_gqa(probs.flatten(1, 2), heads, reduction).sum(2)
    if add_scores:
        start = 0
        for part, (_, _, tags) in zip(parts, dense, strict=True):
            d = delta[..., start : start + part.slots]
            start += part.slots
            if isinstance(part, DenseSlots):
                if part.score is not None:
                    part.score.add_(d)
                continue
            live = tags > 0
            at = part.score_offsets()[live] // 4
            part.pool.view(torch.float32).view(-1).index_add_(0, at, d[live])
    return out, delta


def check_candidates(
    name: str, counts: torch.Tensor, tables: Sequence, tpp: Sequence[int], layouts: Sequence, m: Sequence[int],
    exit_pos: torch.Tensor, exit_score: torch.Tensor,
) -> int:  # fmt: skip
    """Raise on a candidate read (``PagedTiers.candidates``' contract) whose tiers or exits disagree; return the
    exits' count."""
    bsz, heads, tiers = counts.shape
    if not len(tables) == len(tpp) == len(layouts) == len(m) == tiers:
        raise ValueError(f"{name}: {tiers} tiers in counts, {len(tables)} tables, {len(m)} widths")
    n_exit = exit_pos.numel()
    if tuple(exit_score.shape) != (bsz, heads, n_exit):
        raise ValueError(f"{name}: exit_score {tuple(exit_score.shape)}, expected {(bsz, heads, n_exit)}")
    return n_exit
