"""The dense window of the most recent W tokens of one layer, kept in the model dtype.

New tokens always land here first; a token leaves only when W newer ones have arrived, and only
then is its tier decided (DESIGN §3: window -> original | quantized | evicted). A ring keeps the
decode step O(1) in copies: the slot of the oldest token is overwritten in place.
Every row of a batch shares one logical timeline (left padding is part of it), so positions
are one ``[W]`` vector; scores are per (row, head).
"""

from __future__ import annotations

import torch


class WindowRing:
    def __init__(self, batch: int, heads: int, window: int, head_dim: int, dtype: torch.dtype, device) -> None:
        if window < 1:
            raise ValueError(f"TriStateConfig.window={window} must be >= 1")
        self.window = window
        self.k = torch.zeros(batch, heads, window, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((window,), -1, dtype=torch.int64, device=device)
        self.score = torch.zeros(batch, heads, window, dtype=torch.float32, device=device)
        self.filled = 0  # tokens ever pushed; the ring holds min(filled, W) of them

    @property
    def count(self) -> int:
        return min(self.filled, self.window)

    def order(self) -> torch.Tensor:
        """Ring slots from oldest to newest."""
        n, w = self.count, self.window
        start = self.filled - n
        return (torch.arange(start, start + n, device=self.pos.device)) % w

    def push(
        self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add ``n`` tokens (``k, v [B, H, n, D]``, ``pos [n]``); return the tokens pushed out, oldest first.

        Returns ``(k, v, pos [m], score [B, H, m])`` with ``m = max(0, count + n - W)``.
        """
        n, w = k.shape[2], self.window
        overflow = max(0, self.count + n - w)
        if n == 1:
            slot = self.filled % w
            take = slice(slot, slot + overflow)
            out = (
                self.k[:, :, take].clone(),
                self.v[:, :, take].clone(),
                self.pos[take].clone(),
                self.score[:, :, take].clone(),
            )
            self.k[:, :, slot] = k[:, :, 0]
            self.v[:, :, slot] = v[:, :, 0]
            self.pos[slot] = pos[0]
            self.score[:, :, slot] = 0.0
            self.filled += 1
            return out
        order = self.order()
        all_k = torch.cat([self.k[:, :, order], k.to(self.k.dtype)], dim=2)
        all_v = torch.cat([self.v[:, :, order], v.to(self.v.dtype)], dim=2)
        all_pos = torch.cat([self.pos[order], pos.to(self.pos.dtype)])
        zeros = torch.zeros(*self.score.shape[:2], n, dtype=torch.float32, device=self.score.device)
        all_score = torch.cat([self.score[:, :, order], zeros], dim=2)
        keep = min(w, all_pos.numel())
        self.k.zero_()
        self.v.zero_()
        self.pos.fill_(-1)
        self.score.zero_()
        self.k[:, :, :keep] = all_k[:, :, -keep:]
        self.v[:, :, :keep] = all_v[:, :, -keep:]
        self.pos[:keep] = all_pos[-keep:]
        self.score[:, :, :keep] = all_score[:, :, -keep:]
        self.filled = keep
        return all_k[:, :, :overflow], all_v[:, :, :overflow], all_pos[:overflow], all_score[:, :, :overflow]

    def add_scores(self, delta: torch.Tensor) -> None:
        """``delta [B, H, W]`` aligned with ring slots (unused slots are ignored)."""
        self.score += delta

    def select_rows(self, index: torch.Tensor) -> None:
        self.k, self.v, self.score = self.k[index], self.v[index], self.score[index]

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.pos, self.score]
