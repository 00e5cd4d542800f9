"""Left padding and attention sinks of a layer's rows: where each row's real tokens start, what the host knows of it.

Why a part of its own: a left-padded batch leaves padding tokens in every row's first positions. They are never
kept (a policy run evicts them as they leave the window), the first ``sink_tokens`` real ones are (attention sinks),
and the kernels mask them by position. Asking on the device whether an exit is padding costs a GPU step a wait, so
the host keeps what it can know for sure: whether any row is padded at all (a prompt without a mask is not), and,
read once per prompt when first needed, the longest row's padding, past which no exit is padding and a policy run
takes its unpadded paths (``hfkv.layer.policy_runner``). These numbers follow the rows when a batch is reordered.
"""

from __future__ import annotations

import torch


class Padding:
    """The padding and sink ends of one layer's rows (``layer``: the TriStateLayer, for its device and window)."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.pad_end: torch.Tensor | None = None  # [B] leading padding tokens per row
        self.sink_end: torch.Tensor | None = None  # [B] positions below this are sinks
        # Whether some row may be left-padded (host-side: a prompt without a mask is not; else read once per
        # prefill on a CPU, assumed on a GPU): without padding every token leaving the window is real, which a
        # policy run's admission can take as it is (Moves.admit_exits), and Budget.nothing_competes can decide on
        # the host.
        self.padded = True
        self._pad_max: int | None = None  # the largest row's leading padding, read when first needed (exits_padded)

    def set_prompt(self, key_valid: torch.Tensor, unpadded: bool, sink_tokens: int) -> None:
        """The rows of a prompt whose real keys are ``key_valid [B, T]`` (``unpadded``: known to be all of them)."""
        self.pad_end = (~key_valid).long().cumprod(-1).sum(-1)  # leading padding per row
        self.refresh(unpadded=unpadded)
        self.sink_end = self.pad_end + sink_tokens

    def not_padding(self, pos: torch.Tensor) -> torch.Tensor:
        """``[B, H, m]``: which of the window tokens at ``pos [m]`` are real (left padding is never kept)."""
        m = pos.numel()
        shape = self.layer.window.shape
        return (pos.view(1, 1, m) >= self.pad_end.view(-1, 1, 1)).expand(shape[0], shape[1], m)

    def refresh(self, unpadded: bool = False) -> None:
        """``unpadded``: the caller knows no row is padded (a prompt without a mask; rows selected from an unpadded
        batch), which needs no read of ``pad_end``; else it is read on a CPU and assumed on a GPU."""
        self.padded = not unpadded and (self.layer.device.type != "cpu" or bool(self.pad_end.any()))
        self._pad_max = None

    def exits_padded(self, first: int | None) -> bool:
        """Whether some of a run's exits may be left padding, the oldest at logical position ``first`` (None: not
        known on the host, a chunk's). Past the longest row's padding (read once a prompt, when first asked: on a
        GPU one wait, where every run of a padded batch would wait to ask whether everything fits) none is, and a
        run takes the unpadded paths: the exits admitted as they are, the room decided on the host."""
        if not self.padded:
            return False
        if first is None:
            return True
        if self._pad_max is None:
            self._pad_max = int(self.pad_end.max()) if self.pad_end.numel() else 0
        return first < self._pad_max

    def select_rows(self, index: torch.Tensor) -> None:
        """The rows ``index`` selects (beam search, batch surgery), in that order."""
        if self.pad_end is not None:
            self.pad_end = self.pad_end[index]
        if self.sink_end is not None:
            self.sink_end = self.sink_end[index]
        if self.pad_end is not None:  # None: no prompt attended yet, so no padding read from a mask
            self.refresh(unpadded=not self.padded)

    def reset(self) -> None:
        self.pad_end = self.sink_end = None
        self.padded, self._pad_max = True, None
