"""Learned retention (TRIM-KV): a token's importance predicted when it is created, decayed with its age.

Attention-derived scores need the probabilities every query gives every token, which fused and flash attention never
materialise; they also judge a token only by the queries seen so far. TRIM-KV (the paper in docs/generate.md,
"Learned retention") learns instead, per layer and KV head, a small gate that reads a token once, as it enters the
cache, and gives its retention ``beta`` in (0, 1); ``t`` steps later the token is worth ``beta ** t``, and when the
budget is exceeded the lowest go. A sink learns ``beta`` near 1, a filler word a low one; a sliding window is what
every ``beta < 1`` gives without being told.

The gate reads what the cache is handed, the key and value after RoPE: the value as it is, and the key as the norm
of each rotary pair (RoPE turns the pair ``(i, i + D/2)`` by an angle of the position and keeps its length), so the
features do not depend on where the token stands. A gate is a one-hidden-layer MLP per KV head; its weights are
trained by ``hfkv train-gates`` (hfkv.calibration.gates_train) and kept in a gates file (hfkv.gates).

Everything here is pure torch on ``[B, H, ...]`` tensors, with no loop over heads or tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["KINDS", "GateWeights", "gate_features", "gate_values", "retention_scores"]

# What a gate predicts: "retention", TRIM-KV's ``log beta`` (a token's worth decays as ``beta ** age``), or
# "surrogate", KVzap's static importance (the log of the most attention any later query gives the token).
KINDS: tuple[str, ...] = ("retention", "surrogate")


@dataclass
class GateWeights:
    """One layer's gates, one per KV head: ``w1 [H, F, M]``, ``b1 [H, M]``, ``w2 [H, M]``, ``b2 [H]`` (``F`` the
    features of :func:`gate_features`, ``M`` the hidden width)."""

    w1: Tensor
    b1: Tensor
    w2: Tensor
    b2: Tensor

    def to(self, device: torch.device | str) -> GateWeights:
        return GateWeights(*(t.to(device=device, dtype=torch.float32) for t in (self.w1, self.b1, self.w2, self.b2)))

    @property
    def heads(self) -> int:
        return self.w1.shape[0]

    @property
    def features(self) -> int:
        return self.w1.shape[1]


def feature_count(head_dim: int) -> int:
    """How many features a head of ``head_dim`` gives a gate: ``head_dim / 2`` key pair norms and the value."""
    return head_dim // 2 + head_dim


def gate_features(key: Tensor, value: Tensor) -> Tensor:
    """``[B, H, T, D/2 + D]`` fp32 features of tokens' keys and values ``[B, H, T, D]`` (after RoPE): each rotary
    pair's norm, then the value."""
    half = key.shape[-1] // 2
    k = key.float()
    pair = torch.sqrt(k[..., :half].square() + k[..., half:].square())
    return torch.cat([pair, value.float()], dim=-1)


def gate_logits(x: Tensor, gates: GateWeights) -> Tensor:
    """``[B, H, T]`` the gates' outputs on features ``x [B, H, T, F]``."""
    hidden = torch.relu(torch.einsum("bhtf,hfm->bhtm", x, gates.w1) + gates.b1[None, :, None, :])
    return torch.einsum("bhtm,hm->bht", hidden, gates.w2) + gates.b2[None, :, None]


def gate_values(key: Tensor, value: Tensor, gates: GateWeights, kind: str = "retention") -> Tensor:
    """``[B, H, T]`` fp32 what a gate says of each token: ``log beta`` (``kind="retention"``, the log of its
    retention per step of age, ``<= 0``) or its log importance (``"surrogate"``)."""
    logit = gate_logits(gate_features(key, value), gates)
    return F.logsigmoid(logit) if kind == "retention" else logit


def retention_scores(
    values: Tensor, pos: Tensor, valid: Tensor, length: int, across_heads: bool = False, kind: str = "retention"
) -> Tensor:
    """What candidates at positions ``pos [B, H, N]`` are worth in a sequence ``length`` long (``values``: each one's
    :func:`gate_values`, the same shape; ``valid``: which are real): their retention ``beta ** age``, or their
    static importance, normalised so a head's scores sum to 1, as one query's attention does: the scale the
    policy's thresholds and score prior are set for (uniform retention is 1/N, as uniform attention is).
    ``across_heads`` (``head_adaptive``, where a layer's heads share its room by score): normalised over the
    layer's heads together, times their number, so a head whose tokens last keeps more room."""
    if kind == "retention":
        age = (length - 1 - pos).clamp_min(0).to(torch.float32)
        logits = torch.where(valid, age * values.float(), float("-inf"))
    else:
        logits = torch.where(valid, values.float(), float("-inf"))
    if across_heads:
        bsz, heads, n = logits.shape
        out = torch.softmax(logits.reshape(bsz, 1, heads * n), dim=-1).reshape(bsz, heads, n) * heads
    else:
        out = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(out, nan=0.0)  # a row with no valid candidate
