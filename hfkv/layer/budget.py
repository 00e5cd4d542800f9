"""A layer's budget arithmetic: what its tokens cost, the room its tiers have, and the host-side questions on them.

Why a part of its own: a budget (``TriStateConfig.budget`` in tokens, full-precision tokens or bytes per KV head) is
fixed at a layer's first tensors (record costs, the window's reserve, the room, each tier's fidelity, and the errors
of a budget that cannot work), and then asked every step (is a policy run due because the window would overflow
it?) and every run (does anything compete for the room? how many exact tokens may ARKV's ratio keep?). Those
answers must come from the host (no step may wait on the device), so the fullest row's held count is kept here
(``tier_peak``) and refreshed whenever the tiers change. The policy runner and the prefill ask; nothing here moves
a token.
"""

from __future__ import annotations

import torch

from hfkv.quant.fidelity import tier_fidelity
from hfkv.states import ORIGINAL, TIER_NAMES
from hfkv.storage.window import WindowRing


class Budget:
    """The budget of one layer (``layer``: the TriStateLayer, whose window and layouts exist already)."""

    def __init__(self, layer, dim: int) -> None:
        """Set up before the layer's window and tiers exist (a layer holding its sequence dense has neither):
        costs come from the config, the layouts and the model dtype."""
        self.layer = layer
        self.cfg = cfg = layer.cfg
        # Largest tier-held count of a head (or of a row's heads with head_adaptive), kept on the host so
        # the per-step "over budget?" check needs no device sync; refreshed whenever the tiers change.
        self.tier_peak = 0
        self._cost_t: torch.Tensor | None = None  # self.cost per tier on the tiers' device (0: a tier that is off)
        self._cap_memo: tuple | None = None  # (ratios, their row's shape, heads and room, exact cap): exact_cap
        # Host-side, once: asked at every policy run (nothing_competes), and a device read there is a sync.
        self.has_floor = bool((layer.cache.alpha_l[layer.layer_idx] > 0).any())
        self.memory_budget = cfg.budget is not None and cfg.budget_unit != "tokens"
        self.cost: tuple[int | None, ...] | None = None
        self.window_cost = self.cap = self.room = None
        self.fidelity: tuple[float | None, ...] | None = None
        # The layer's room as a multiple of the config's (TriStateConfig.layer_adaptive); None: not given yet.
        self._share: float | None = None if cfg.layer_adaptive else 1.0
        self._even: tuple[int, int] | None = None  # (cap, reserve) of an even split, what a share scales
        if self.memory_budget:
            self._init_memory_budget(dim)

    def _init_memory_budget(self, dim: int) -> None:
        """Costs and room of a byte budget (``budget_unit`` ``fp_tokens`` or ``bytes``).

        The window's tokens cost their K/V in the model dtype plus a score each; the ring can hold
        ``W + interval`` of them before the next policy run, so that much is reserved and the tiers
        get the rest: the bound then holds at every step without a run per step.
        """
        cfg, layouts = self.cfg, self.layer.layouts
        token_bytes = 2 * dim * self.layer.dtype.itemsize
        capacity = WindowRing.capacity_for(cfg.window, cfg.interval)
        on = (True, cfg.uses_mid_tier(), True)
        # Bytes of one record per tier (None: the mid tier is off), what the allocator trades.
        self.cost = tuple(lay.nbytes if used else None for lay, used in zip(layouts, on, strict=True))
        self.window_cost = token_bytes + 4
        cap = cfg.budget * token_bytes if cfg.budget_unit == "fp_tokens" else cfg.budget
        reserve = capacity * self.window_cost
        self._even = (cap, reserve)
        self._set_room(1.0 if self._share is None else self._share)
        used = [(name, getattr(cfg, name), c) for name, c in zip(TIER_NAMES, self.cost, strict=True) if c is not None]
        for (hi, hi_fmt, hi_c), (lo, lo_fmt, lo_c) in zip(used, used[1:], strict=False):
            if lo_c > hi_c:
                raise ValueError(
                    f"TriStateConfig.{lo}={lo_fmt} records ({lo_c} bytes) are larger than {hi}={hi_fmt} records "
                    f"({hi_c} bytes); a memory budget needs each tier cheaper than the one above it"
                )
        if cfg.fidelity is not None:
            fid = list(cfg.fidelity)
            self.fidelity = tuple(fid.pop(0) if c is not None else None for c in self.cost)
        else:
            self.fidelity = tuple(
                tier_fidelity(lay.key.name, lay.value.name, lay.key.group_size, dim) if c is not None else None
                for lay, c in zip(layouts, self.cost, strict=True)
            )

    def _set_room(self, share: float) -> None:
        """``cap`` and ``room`` with the room outside the window ``share`` times an even split's: the window's
        reserve is the same in every layer (its tokens are the newest, whatever the layer)."""
        cfg = self.cfg
        cap, reserve = self._even
        self.cap = reserve + round(share * (cap - reserve))
        self.room = int(cfg.slack * (self.cap - reserve))
        if self.room < self.cost[0]:
            given = "" if share == 1.0 else f", {share:.3g} times an even split's room (layer_adaptive)"
            raise ValueError(
                f"TriStateConfig.budget={cfg.budget} ({cfg.budget_unit} per KV head = {cap} bytes{given}) leaves "
                f"{self.room} bytes outside the window of layer {self.layer.layer_idx}, less than one "
                f"{self.cost[0]}-byte record: the window (window + interval = {reserve // self.window_cost} tokens x "
                f"{self.window_cost} bytes) takes {reserve}; raise the budget or lower window/interval"
            )

    @property
    def share(self) -> float | None:
        """The layer's room outside the window as a multiple of an even split's (``TriStateConfig.layer_adaptive``:
        :func:`hfkv.compress` sets it from every layer's scores before the layer's tokens are placed; 1 otherwise).
        None: a layer_adaptive layer that was not given one yet."""
        return self._share

    @share.setter
    def share(self, share: float | None) -> None:
        if share is None:  # a file saved before shares existed holds none: an even split, unless shares are asked
            self._share = None if self.cfg.layer_adaptive else 1.0
            return
        share = float(share)
        if not share > 0 or share == float("inf"):
            raise ValueError(
                f"layer {self.layer.layer_idx}: a room share must be a positive finite number, got {share}"
            )
        if share != 1.0 and not self.memory_budget:
            raise ValueError(
                f"layer {self.layer.layer_idx}: a room share of {share:.3g} needs a memory budget (budget_unit "
                f"'fp_tokens' or 'bytes'), not TriStateConfig.budget={self.cfg.budget!r} {self.cfg.budget_unit}"
            )
        self._share = share
        if self.memory_budget:
            self._set_room(share)
            self._cap_memo = None

    def refresh_peak(self) -> None:
        """``tier_peak`` from the tiers' counts as they are now (one read)."""
        counts = self.layer.tiers.counts
        if self.memory_budget:  # bytes: each tier's count times its record's (a product and a sum, 2 launches)
            if self._cost_t is None or self._cost_t.device != counts.device:
                costs = [c if c is not None else 0 for c in self.cost]
                self._cost_t = torch.tensor(costs, dtype=counts.dtype, device=counts.device)
            held = (counts * self._cost_t).sum(-1)
        else:
            held = counts.sum(-1)  # [B, H] tokens
        held = held.sum(-1) if self.cfg.head_adaptive else held
        self.tier_peak = int(held.max()) if held.numel() else 0

    def weights(self) -> tuple[list[int], int]:
        """Each tier's weight in ``tier_peak`` (its record's bytes, or 1 a token) and the heads that share a room."""
        tiers = self.layer.tiers
        cost = [c or 0 for c in self.cost] if self.memory_budget else [1] * tiers.num_tiers
        return cost, tiers.counts.shape[1] if self.cfg.head_adaptive else 1

    def window_overflows(self, count: int) -> bool:
        """Whether ``count`` tokens in the window (the same in every head: between policy runs only the window
        grows) take the fullest row past the budget. From host numbers only: no step waits on the device."""
        cfg = self.cfg
        if cfg.budget is None:
            return False
        heads = self.layer.window.shape[1] if cfg.head_adaptive else 1
        if self.memory_budget:
            return self.tier_peak + heads * count * self.window_cost > heads * self.cap
        return self.tier_peak + heads * count > heads * cfg.budget

    def exact_cap(self, rho: torch.Tensor, heads: int) -> torch.Tensor:
        """ARKV's OQ ratio as a cap on exact tokens: the layer's share of the exact tokens that would fit in
        the room (``[B]`` with ``head_adaptive``, else ``[B, H]``)."""
        # rho is the cache's row for this layer, the same tensor until the ratios are invalidated
        key = (tuple(rho.shape), heads, self.room)
        if self._cap_memo is not None and self._cap_memo[0] is rho and self._cap_memo[1] == key:
            return self._cap_memo[2]  # the same ratios: the same cap, without its launches every policy run
        layer = self.layer
        room = self.room * (heads if self.cfg.head_adaptive else 1)
        cap = torch.floor(rho.to(layer.device).float() * (room / self.cost[ORIGINAL])).long()
        cap = cap if self.cfg.head_adaptive else cap.view(-1, 1).expand(cap.shape[0], heads).contiguous()
        self._cap_memo = (rho, key, cap)  # contiguous: the allocation takes it as it is, no copy a run
        return cap

    def rho_past_budget(self, length: int, window_count: int) -> torch.Tensor | None:
        """ARKV's OQ ratios once the sequence has outgrown the budget, None before: while every token of the layer
        (``length``, ``window_count`` of them in the window) would fit the budget exact, the cap on exact tokens
        would quantize for nothing, and the cache is to be the full cache (docs/generate.md, "A budget that covers
        the sequence"; ARKV's tailor, which applies the ratios, "will be triggered when the KV cache reaches the
        limit"). Decided on the host from the layer's length: the longest row's, so a padded row fits too."""
        if self.cfg.budget is None:
            return None
        if self.memory_budget:
            fits = (length - window_count) * self.cost[ORIGINAL] <= self.room
        else:
            fits = length <= self.cfg.budget
        return None if fits else self.layer.cache.rho(self.layer.layer_idx)

    def over_room(self, exits: int, padded: bool) -> bool:
        """Whether the fullest row (its held bytes are ``tier_peak``, known since the tiers last changed) cannot take
        its ``exits`` exact, under a byte budget without floors, where no exit is padding (``padded`` False): then it
        holds more than its room as it is, so neither this run's host check nor the allocation's "does everything
        fit?" can say yes. Decided on the host, no tensor operation or wait (a long context's every run)."""
        if not self.memory_budget or self.has_floor or padded:
            return False
        per = self.layer.tiers.counts.shape[1] if self.cfg.head_adaptive else 1
        return self.tier_peak + per * exits * self.cost[ORIGINAL] > per * self.room

    def nothing_competes(self, exit_pos: torch.Tensor, padded: bool) -> bool:
        """Whether a policy run can only admit the exits exact: a byte budget that every held token and every
        exit (at full precision) fits, no eviction floor (``alpha_l <= 0``: a floor can evict whatever the
        room) and no cap on exact tokens (ARKV's OQ ratio; none while the sequence fits, :meth:`rho_past_budget`).
        Then :func:`allocate` returns the current states and ``ORIGINAL`` for the exits (padding: evicted) without
        ranking anything, and reading every tier's metadata to ask it would be the run's whole cost: at short
        contexts most runs are these (``padded``: some exit may be padding)."""
        if not self.memory_budget or self.has_floor or self.over_room(exit_pos.numel(), padded):
            return False
        layer = self.layer
        heads = layer.tiers.counts.shape[1]
        per = heads if self.cfg.head_adaptive else 1
        counts = layer.tiers.counts
        # [B, H] exits that would be held exact (all of them without padding)
        entering = layer.padding.not_padding(exit_pos).sum(-1) if padded else exit_pos.numel()
        held = sum(counts[..., t] * c for t, c in enumerate(self.cost) if c is not None)  # [B, H] bytes
        held = held + entering * self.cost[ORIGINAL]
        exact = counts[..., ORIGINAL] + entering  # sinks included: at least what allocate() counts
        if self.cfg.head_adaptive:
            held, exact = held.sum(-1), exact.sum(-1)
        fits = (held <= self.room * per).all()
        rho = self.rho_past_budget(layer.length, layer.window.count)
        if rho is not None:  # both conditions in one host read
            fits = fits & (exact <= self.exact_cap(rho, heads)).all()
        return bool(fits)
