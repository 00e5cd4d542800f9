"""A layer's sequence held dense, as DynamicCache holds it, while its budget would keep every token exact.

Why a part of its own: while every token a layer has seen fits its budget at full precision, the policy keeps them
all exact, and the window ring and paged tiers would only add bytes (a tag and a score per record, the ring's free
slots, each head's last page) and change the arithmetic: one joint softmax over slots sums in another order than
the model's SDPA, which in bf16 alone moves greedy output off DynamicCache's. So the layer holds what DynamicCache
holds, keys and values ``[B, H, T, D]`` in the model dtype grown by one concatenation a step, and attends with the
model's SDPA over them: its outputs are DynamicCache's, bit for bit (docs/generate.md, "A budget that covers the
sequence"). It adds each token's score sum (4 bytes a token and KV head), what the policy will rank by: the prompt's
from its observation window (:func:`hfkv.layer.prefill.observe_prompt`), later ones from each step's queries, as the
window and tiers would have received them, added every ``interval`` steps (the queries held until then). When a
chunk would take the sequence past what the tiers could hold exact, the sequence is placed in the window and tiers
as a prompt of that length would be (:func:`hfkv.layer.prefill.place_prompt`) and the layer goes on compressed; it
never comes back.

Not for a layer whose policy may drop or quantize tokens whatever the room (an eviction floor ``alpha_l > 0``, no
budget), nor with ``TriStateConfig.dense_phase`` off (tests of the tiers' machinery on short sequences).
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hfkv.layer import prefill
from hfkv.policy.scores import reduce_gqa
from hfkv.quant.rotation import rotate
from hfkv.states import EVICTED, ORIGINAL


class DensePhase:
    """The dense keys, values and score sums of one layer (``layer``: the TriStateLayer) before it compresses."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.active = False  # the layer holds its sequence here (decided at its first tensors)
        self.k: torch.Tensor | None = None  # [B, H, T, D] as update() received them (never rotated)
        self.v: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None  # [B, H, T] fp32 score sums
        self.key_valid: torch.Tensor | None = None  # [B, T] real tokens (False: left padding)
        # Queries whose scores are not added yet, observed together every ``interval`` steps (one fp32 pass over the
        # keys for all of them, not one a step; :meth:`observe`): the first ``pending`` rows of a buffer of
        # ``interval`` query positions, copied in (a replayed CUDA graph rewrites its own), from logical position
        # ``pending_start`` on, with one scaling. A buffer and a count, not a list: a step compiled by Dynamo then
        # traces once (a list's length is guarded, hfkv.compiled).
        self.queries: torch.Tensor | None = None  # [B, Hq, interval, D]
        self.pending = 0
        self.pending_start = 0
        self.scaling = 1.0

    def eligible(self) -> bool:
        """Whether the layer's policy keeps every token exact while the budget has room (module doc): a budget, no
        eviction floor, and under a budget in tokens no ``alpha_h`` above 0 (there a token scoring below
        ``alpha_h / N`` is quantized whatever the room: the ``quant`` preset; under a memory budget ``alpha_h``
        only makes a token exact-or-nothing)."""
        layer = self.layer
        cfg, budget = layer.cfg, layer.budget
        if not cfg.dense_phase or cfg.budget is None or budget.has_floor:
            return False
        return budget.memory_budget or bool((layer.cache.alpha_h[layer.layer_idx] <= 0).all())

    def fits(self, length: int) -> bool:
        """Whether a sequence ``length`` long would be held exact: a memory budget's room takes every token the
        window leaves to the tiers at full precision (ARKV's ratios apply only past that,
        :meth:`hfkv.layer.budget.Budget.rho_past_budget`); a budget in tokens holds ``length`` tokens."""
        cfg, budget = self.layer.cfg, self.layer.budget
        if budget.memory_budget:
            return max(0, length - cfg.window) * budget.cost[ORIGINAL] <= budget.room
        return length <= cfg.budget

    def reset(self) -> None:
        self.k = self.v = self.scores = self.key_valid = self.queries = None
        self.pending = 0
        self.active = self.eligible()

    # ------------------------------------------------------------ the sequence
    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Take a chunk's keys and values; returns every held one, as DynamicLayer.update does."""
        if self.k is None:  # contiguous, as DynamicCache's concatenation leaves them (SDPA's CPU kernels read
            self.k, self.v = key.contiguous(), value.contiguous()  # strided bf16 7-9% slower: prefill.attend_prompt)
        else:
            self.k, self.v = torch.cat([self.k, key], dim=-2), torch.cat([self.v, value], dim=-2)
        retention = self.layer.retention
        if retention.active:  # the tokens' fields hold the gates' values, from their arrival (hfkv.layer.retention)
            fresh = retention.take()
            self.scores = fresh if self.scores is None else torch.cat([self.scores, fresh], -1)
        return self.k, self.v

    def attend(self, module, query: torch.Tensor, mask, scaling: float, computed: torch.Tensor | None = None):
        """The output over the held keys and values, DynamicCache's (``computed`` by the model's own attention, or
        SDPA's); the scores the queries gave each token: a prompt's from its observation window now, a later
        chunk's with the next ones (:meth:`observe`)."""
        out = computed if computed is not None else sdpa_attention_forward(module, query, self.k, self.v, mask,
                                                                           scaling=scaling)[0]  # fmt: skip
        q, t = query.shape[2], self.k.shape[2]
        learned = self.layer.retention.active  # nothing to add to the fields: no queries kept
        if self.key_valid is None:
            sums, self.key_valid = prefill.observe_prompt(self.layer, self.k, query, mask, scaling)
            if not learned:
                self.scores = sums
            return out
        self.key_valid = torch.cat([self.key_valid, self.key_valid.new_ones(self.key_valid.shape[0], q)], -1)
        if not learned:
            self.scores = torch.cat([self.scores, self.scores.new_zeros(*self.scores.shape[:2], q)], -1)
            self._hold(query, scaling, t - q)
        return out

    def _hold(self, query: torch.Tensor, scaling: float, start: int) -> None:
        """Keep a chunk's queries (from logical position ``start``) until :meth:`observe` adds their scores."""
        interval, q = self.layer.cfg.interval, query.shape[2]
        if self.pending and (self.pending + q > interval or scaling != self.scaling):
            self.observe()
        if q > interval:  # a chunk longer than the buffer: its scores now
            self.queries, self.pending, self.pending_start, self.scaling = query, q, start, scaling
            self.observe()
            return
        if self.queries is None or self.queries.shape[:2] != query.shape[:2] or self.queries.shape[2] != interval:
            self.queries = query.new_empty(*query.shape[:2], interval, query.shape[3])
        if not self.pending:
            self.pending_start, self.scaling = start, scaling
        self.queries[:, :, self.pending : self.pending + q].copy_(query)
        self.pending += q
        if self.pending >= interval:
            self.observe()

    def observe(self) -> None:
        """Add the pending queries' probabilities, reduced over each GQA group, to the score sums: what the window
        and tiers receive a step at a time, here for ``interval`` steps at once, so the keys are read in fp32 once
        for all of them (a step each would cost a fifth of a short context's decode step). Masked as the tiers'
        kernels mask, by position: a query sees the real keys at or before its own position."""
        if not self.pending:
            return
        k, reduction = self.k, self.layer.cfg.score_reduction
        bsz, heads, t, dim = k.shape
        keys = k.float().transpose(-1, -2)  # [B, H, D, T]
        pos = torch.arange(t, device=k.device)
        n = self.pending
        query = self.queries[:, :, :n]  # [B, Hq, n, D]
        first = torch.arange(self.pending_start, self.pending_start + n, device=k.device)  # [n]
        g = query.shape[1] // heads
        qf = query.float().mul(self.scaling).reshape(bsz, heads, g * n, dim)
        logits = torch.matmul(qf, keys).view(bsz, heads, g, n, t)
        seen = (pos.view(1, t) <= first.view(n, 1)).view(1, 1, 1, n, t) & self.key_valid[:, None, None, None, :t]
        probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), -1).nan_to_num_(0.0)
        self.scores += reduce_gqa(probs.flatten(1, 2), heads, reduction).sum(2)
        self.pending = 0
        if self.queries.shape[2] != self.layer.cfg.interval:  # a long chunk's own queries: not a buffer to keep
            self.queries = None

    def ingest(self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, scaling: float) -> None:
        """A prompt's captured tensors (TriStateLayer.ingest_prefill), held as a forward over it would leave them."""
        self.append(key, value)
        sums, self.key_valid = prefill.observe_prompt(self.layer, self.k, query, None, scaling)
        if not self.layer.retention.active:
            self.scores = sums

    def leave(self) -> None:
        """Place the held sequence in the layer's window and tiers (built now) and stop holding it here."""
        layer = self.layer
        self.observe()
        k, v = self.k, self.v
        if layer.rotation is not None:  # the tiers hold keys and values rotated (TriStateLayer.update)
            k, v = rotate(k, layer.rotation), rotate(v, layer.rotation)
        layer.build_storage()
        prefill.place_prompt(layer, k, v, self.scores, self.key_valid)
        self.k = self.v = self.scores = self.key_valid = self.queries = None
        self.active = False

    def crop(self, n: int) -> None:
        """Drop the last ``n`` tokens (TriStateLayer.crop): their keys and values, and their own queries if still
        pending. The scores rejected tokens' queries already gave the kept ones stay: they only weigh a later
        decision, while every token here is exact."""
        keep = self.k.shape[2] - n
        if keep < 0:
            raise ValueError(f"TriStateCache.crop: cannot remove {n} tokens of {self.k.shape[2]}")
        self.pending = max(0, min(self.pending, keep - self.pending_start))
        self.k, self.v = self.k[:, :, :keep], self.v[:, :, :keep]
        self.scores, self.key_valid = self.scores[..., :keep], self.key_valid[:, :keep]

    def select_rows(self, index: torch.Tensor) -> None:
        self.observe()  # the pending queries belong to the rows as they were
        self.queries = None  # made again for the new rows
        if self.k is not None:
            self.k, self.v = self.k[index], self.v[index]
        if self.scores is not None:  # None: keys taken by update() alone, not attended yet (observed when they are)
            self.scores = self.scores[index]
        if self.key_valid is not None:
            self.key_valid = self.key_valid[index]

    # ------------------------------------------------------------ what it holds
    def held_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.scores, self.queries) if t is not None]

    def token_states(self) -> torch.Tensor:
        """``[B, H, T]``: every real token exact (ORIGINAL), left padding EVICTED (held, never attended)."""
        bsz, heads = self.k.shape[:2]
        state = torch.where(self.key_valid, ORIGINAL, EVICTED).to(torch.int8)
        return state[:, None].expand(bsz, heads, -1)
