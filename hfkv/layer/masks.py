"""The attention mask a compressing layer reads, from whichever mask the model's attention implementation built.

Why: hfkv no longer replaces the model's attention implementation (hfkv.attention.interface), so the mask a
forward builds is the one its implementation asks for: SDPA's boolean mask (or None where plain causal), eager's
additive float mask, flash attention's ``[B, kv]`` padding mask (or None). A layer that attends over its window and
tiers reads slots by logical position and needs one form: boolean ``[B, 1, q, kv]`` in logical coordinates, True
where attended, or None for plain causal without padding. The forms carry the same information, so converting is
exact.
"""

from __future__ import annotations

import torch


def logical_mask(mask: object, query_length: int) -> torch.Tensor | None:
    """``mask`` as a boolean ``[B, 1, q, kv]`` mask (True: attended), or None where it is plain causal."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"hfkv: a compressing layer got an attention mask of type {type(mask).__name__}; it reads boolean or "
            "additive 4D masks (sdpa, eager) and 2D padding masks (flash attention): flex attention's BlockMask is "
            "not supported, load the model with attn_implementation='sdpa' or 'eager'"
        )
    if mask.dim() == 4:
        return mask if mask.dtype == torch.bool else mask == 0  # additive: 0 where attended, the dtype's min else
    if mask.dim() == 2:  # padding [B, kv] (1: a real token), causal implied
        kv = mask.shape[-1]
        pos = torch.arange(kv, device=mask.device)
        causal = pos[None, :] <= (pos[kv - query_length :])[:, None]  # [q, kv]
        return mask.bool()[:, None, None, :] & causal[None, None]
    raise ValueError(f"hfkv: an attention mask of shape {tuple(mask.shape)}; expected [B, 1, q, kv] or [B, kv]")


def mask_rows(mask: object, start: int, stop: int, kv: int) -> object:
    """The mask a forward of queries ``start:stop`` of a chunk over its first ``kv`` keys would have been given: the
    same form, cut (a 4D mask to those rows and columns, a 2D padding mask to those columns; None stays None).
    Why: a chunk attended a token at a time, or again in part (hfkv.layer.rollback), passes each call its own."""
    if not isinstance(mask, torch.Tensor):
        return mask
    if mask.dim() == 4:
        return mask[:, :, start:stop, :kv]
    if mask.dim() == 2:
        return mask[:, :kv]
    raise ValueError(f"hfkv: an attention mask of shape {tuple(mask.shape)}; expected [B, 1, q, kv] or [B, kv]")
