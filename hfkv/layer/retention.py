"""A layer's learned retention (``score_source="retention"``): the gates' value of each token, in its score field.

Why a part of its own: ranked by attention, a token's score field holds the sum of the probabilities every query gave
it, which each attention read adds to. Ranked by learned retention, a gate reads each token once, as it enters the
layer (update(), before any rotation of storage, or a prompt's captured tensors), and its value (``log beta``, or a
surrogate's log importance: hfkv.policy.retention) goes into the same field, where the window, the tiers, their moves,
a fork and a saved file carry it as they carry a score sum: no byte more per token. The reads then add nothing to
it (the kernels' ``add_scores=False``; the gate itself costs a CPU step more than those additions did:
docs/retention.md, "What it costs"), the dense phase keeps no queries, and a policy run turns
the values into what it ranks (:meth:`scores`). This part holds the gates and the current chunk's values, from
update() until the chunk's attention places them.
"""

from __future__ import annotations

import torch

from hfkv.policy.retention import GateWeights, gate_values, retention_scores


class Retention:
    """The learned retention of one layer (``layer``: the TriStateLayer); inactive (``gates`` None) where the config
    ranks by attention."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.gates: GateWeights | None = None
        self.kind = "retention"  # what the gates predict (hfkv.policy.retention.KINDS)
        self.fresh: torch.Tensor | None = None  # [B, H, q] fp32: the values of the chunk update() took last

    @property
    def active(self) -> bool:
        return self.gates is not None

    def initialize(self, gates: GateWeights | None, kind: str, device: torch.device) -> None:
        self.gates, self.kind = (None if gates is None else gates.to(device)), kind

    def read(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """The gates' values of a chunk's tokens ``[B, H, q, D]`` (after RoPE, before any rotation of storage)."""
        self.fresh = gate_values(key, value, self.gates, self.kind) if self.gates is not None else None

    def take(self) -> torch.Tensor:
        """The current chunk's values, for the field of each of its tokens."""
        if self.fresh is None:
            raise RuntimeError(f"layer {self.layer.layer_idx}: a chunk's retention was taken before update() read it")
        return self.fresh

    def scores(self, values: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, length: int) -> torch.Tensor:
        """``[B, H, N]`` what a policy run ranks candidates at ``pos [B, H, N]`` by, from their fields' ``values``
        (``valid``: real ones), in a sequence ``length`` long."""
        return retention_scores(values, pos, valid, length, self.layer.cfg.head_adaptive, self.kind)
