"""The dense window of the most recent tokens of one layer, kept in the model dtype.

New tokens always land here first; a token leaves only when at least W newer ones have arrived,
and only then is its tier decided (window -> original | quantized | evicted: docs/architecture.md,
"Life of a token"). A ring keeps the decode step O(1) in copies. Its capacity is ``W + extra``: with
``extra = interval`` tokens leave in one batch when the policy runs (``pop_oldest``) instead of one encode-and-append
per step; tokens past W stay full precision until then and count against the budget.
Every row of a batch shares one logical timeline (left padding is part of it), so positions
are one ``[capacity]`` vector (``-1`` = empty slot); scores are per (row, head).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PendingWrite(NamedTuple):
    """A decode step's token taken into ring slot ``slot`` but not yet written (``k, v [B, H, 1, D]``)."""

    k: torch.Tensor
    v: torch.Tensor
    slot: int
    pos: int


class WindowRing:
    @staticmethod
    def capacity_for(window: int, extra: int) -> int:
        """Slots of a ring of ``window`` tokens with ``extra`` more before a policy run empties it."""
        return window + max(0, int(extra))

    def __init__(
        self,
        batch: int,
        heads: int,
        window: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
        extra: int = 0,
    ) -> None:
        if window < 1:
            raise ValueError(f"TriStateConfig.window={window} must be >= 1")
        self.window = window
        self.capacity = self.capacity_for(window, extra)
        cap = self.capacity
        self._k = torch.zeros(batch, heads, cap, head_dim, dtype=dtype, device=device)
        self._v = torch.zeros_like(self._k)
        self._pos = torch.full((cap,), -1, dtype=torch.int64, device=device)
        self._score = torch.zeros(batch, heads, cap, dtype=torch.float32, device=device)
        self.start = 0  # ring slot of the oldest token
        self.count = 0  # tokens held
        # What a push that displaces nothing returns. Made with the ring's tensors, never on first use: a compiled
        # decode step would otherwise guard on whether it exists yet, and recompile once it does.
        self._empty = self.empties()
        self.pending: PendingWrite | None = None
        self._popped: tuple[int, int] | None = None  # (first slot, n): popped as views, not yet emptied

    # A decode step's token can be written by the attention kernel that reads the ring (one launch instead
    # of four small ones, push_deferred): until then it is `pending`, and every read of the ring's tensors
    # below writes it first, so no reader sees a ring without it.
    @property
    def k(self) -> torch.Tensor:
        self.flush()
        return self._k

    @property
    def v(self) -> torch.Tensor:
        self.flush()
        return self._v

    @property
    def pos(self) -> torch.Tensor:
        self.flush()
        return self._pos

    @property
    def score(self) -> torch.Tensor:
        self.flush()
        return self._score

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(batch, heads, capacity, head_dim)``, read without writing a pending token."""
        return tuple(self._k.shape)

    def raw(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k, v, pos, score)`` as stored, a pending token not yet in them (its writer's view)."""
        return self._k, self._v, self._pos, self._score

    def flush(self) -> None:
        """Write the pending token with tensor ops (a reader needs it and no kernel wrote it)."""
        w, self.pending = self.pending, None
        if w is not None:
            self._write(w.k, w.v, w.slot, w.pos)

    def push_deferred(
        self, k: torch.Tensor, v: torch.Tensor, pos: int, score: torch.Tensor | None = None
    ) -> int | None:
        """Take one token (``k, v [B, H, 1, D]``) into a free slot without writing it: it becomes ``pending``
        for a kernel to write; returns the slot. None (nothing taken) when the ring is full. ``score [B, H, 1]``:
        the token's field, written now (a kernel that adds no scores leaves it; None: 0, the empty slot's)."""
        self.clear_popped()
        self.flush()
        if self.count == self.capacity or k.shape[2] != 1:
            return None
        slot = (self.start + self.count) % self.capacity
        if score is not None:
            self._score[:, :, slot : slot + 1] = score
        self.pending = PendingWrite(k, v, slot, int(pos))
        self.count += 1
        return slot

    def _write(self, k: torch.Tensor, v: torch.Tensor, slot: int, pos: int | torch.Tensor) -> None:
        # slices, not ``[:, :, slot]``: Dynamo keeps a sliced bound symbolic and specialises an index (a step of
        # hfkv.compiled would be traced again for every slot)
        self._k[:, :, slot : slot + 1] = k[:, :, :1]
        self._v[:, :, slot : slot + 1] = v[:, :, :1]
        # fill_ with a host number is a launch argument; `pos[slot] = int` would copy a CPU scalar to the
        # device (a sync, and no CUDA graph can capture it). An empty slot's score is already 0: vacating
        # a slot zeroes it, and attention adds exact zeros to empty slots.
        if isinstance(pos, int):
            self._pos[slot : slot + 1].fill_(pos)
        else:
            self._pos[slot : slot + 1].copy_(pos[:1])

    def order(self) -> torch.Tensor:
        """Ring slots from oldest to newest."""
        return (self.start + torch.arange(self.count, device=self.pos.device)) % self.capacity

    def _take(self, slots: torch.Tensor):
        return self.k[:, :, slots], self.v[:, :, slots], self.pos[slots], self.score[:, :, slots]

    def pop_oldest(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove and return the ``n`` oldest tokens ``(k, v [B, H, n, D], pos [n], score [B, H, n])``.

        A pending token (the newest) stays pending unless it is popped too: the decode kernel of its step
        still writes it, so a policy run's step launches as the steps between runs do."""
        self.clear_popped()
        n = max(0, min(n, self.count))
        if self.pending is not None and n >= self.count:
            self.flush()
        slots = (self.start + torch.arange(n, device=self._pos.device)) % self.capacity
        out = self._k[:, :, slots], self._v[:, :, slots], self._pos[slots], self._score[:, :, slots]
        self._pos.index_fill_(0, slots, -1)  # index_fill_: the value is a launch argument, not a copied tensor
        self._score.index_fill_(2, slots, 0.0)
        self.start = (self.start + n) % self.capacity
        self.count -= n
        return out

    def peek_oldest(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``[n]`` and scores ``[B, H, n]`` of the ``n`` oldest tokens, in order, left in the ring: what the
        next :meth:`pop_oldest_views` hands a policy run (a run prepared a step ahead classifies them). Views where
        their slots do not wrap around the ring's end, else the two pieces joined (two small copies)."""
        s0, cap = self.start, self.capacity
        if s0 + n <= cap:
            return self._pos[s0 : s0 + n], self._score[:, :, s0 : s0 + n]
        rest = s0 + n - cap
        pos = torch.cat([self._pos[s0:], self._pos[:rest]])
        return pos, torch.cat([self._score[:, :, s0:], self._score[:, :, :rest]], dim=2)

    def pop_oldest_views(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`pop_oldest`, the tokens returned as views of the ring where their slots do not wrap around its end
        (a policy run's exits, nearly always): no gather. Their slots are emptied by :meth:`clear_popped`, which the
        caller runs once it has read them (two fills, where a pop is nine launches: a policy run on a GPU is bound
        by its launches); until then every other change of the ring runs it first."""
        self.clear_popped()
        n = max(0, min(n, self.count))
        s0 = self.start
        if s0 + n > self.capacity or (self.pending is not None and n >= self.count):
            return self.pop_oldest(n)
        at = slice(s0, s0 + n)
        out = self._k[:, :, at], self._v[:, :, at], self._pos[at], self._score[:, :, at]
        if n:
            self._popped = (s0, n)
        self.start = (s0 + n) % self.capacity
        self.count -= n
        return out

    def clear_popped(self) -> None:
        """Empty the slots :meth:`pop_oldest_views` handed out (position -1, score 0)."""
        if self._popped is not None:
            s0, n = self._popped
            self._popped = None
            self._pos[s0 : s0 + n].fill_(-1)
            self._score[:, :, s0 : s0 + n].zero_()

    def empties(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k, v, pos, score)`` holding no token, shaped, typed and placed as the ring's own tensors."""
        bsz, heads, _, dim = self._k.shape
        return (self._k.new_empty(bsz, heads, 0, dim), self._v.new_empty(bsz, heads, 0, dim),
                self._pos.new_empty(0), self._score.new_empty(bsz, heads, 0))  # fmt: skip

    def _nothing(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._empty

    def push(
        self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | int, score: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add ``n`` tokens (``k, v [B, H, n, D]``, ``pos [n]`` or the first of ``n`` consecutive positions; ``score
        [B, H, n]`` their fields, None: 0); return the tokens pushed out, oldest first.

        One token only pushes out the oldest when the ring is at capacity; several tokens (a
        prompt or chunk) leave the newest ``W`` in the ring and return everything older.
        """
        self.clear_popped()
        self.flush()
        n = k.shape[2]
        if n == 1:  # the decode step: a handful of small writes, nothing else
            out = self.pop_oldest(1) if self.count == self.capacity else self._nothing()
            slot = (self.start + self.count) % self.capacity
            self._write(k, v, slot, pos)
            if score is not None:
                self._score[:, :, slot : slot + 1] = score
            self.count += 1
            return out
        if isinstance(pos, int):
            pos = torch.arange(pos, pos + n, device=self.pos.device)
        order = self.order()
        all_k = torch.cat([self.k[:, :, order], k.to(self.k.dtype)], dim=2)
        all_v = torch.cat([self.v[:, :, order], v.to(self.v.dtype)], dim=2)
        all_pos = torch.cat([self.pos[order], pos.to(self.pos.dtype)])
        if score is None:
            score = torch.zeros(*self.score.shape[:2], n, dtype=torch.float32, device=self.score.device)
        all_score = torch.cat([self.score[:, :, order], score.float()], dim=2)
        keep = min(self.window, all_pos.numel())
        out_n = all_pos.numel() - keep
        self.k.zero_()
        self.v.zero_()
        self.pos.fill_(-1)
        self.score.zero_()
        self.k[:, :, :keep] = all_k[:, :, out_n:]
        self.v[:, :, :keep] = all_v[:, :, out_n:]
        self.pos[:keep] = all_pos[out_n:]
        self.score[:, :, :keep] = all_score[:, :, out_n:]
        self.start, self.count = 0, keep
        return all_k[:, :, :out_n], all_v[:, :, :out_n], all_pos[:out_n], all_score[:, :, :out_n]

    def add_scores(self, delta: torch.Tensor) -> None:
        """``delta [B, H, capacity]`` aligned with ring slots (empty slots receive zeros)."""
        self.score.add_(delta)

    def select_rows(self, index: torch.Tensor) -> None:
        self.clear_popped()
        self.flush()
        self._k, self._v, self._score = self._k[index], self._v[index], self._score[index]
        self._empty = self.empties()

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.pos, self.score]
