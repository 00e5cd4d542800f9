"""Past recording: what lets ``crop`` put a compressing layer back exactly, as transformers' sliding and linear
layers do once ``Cache.activate_past_recording()`` was called (assisted and prompt-lookup decoding call it, then
``crop`` after each verification forward to drop the rejected candidates).

Why a record and not an undo of each change: a chunk's tokens push older ones out of the window into the tiers,
their queries add to every held token's score, and a policy run may quantize or evict; none of that can be taken
back from what the layer holds. So the first update after a crop (or after recording starts) copies the layer's
state, and every chunk after it is kept with the query, mask and scaling its attention was called with. ``crop(n)``
restores the copy and runs the kept tokens through ``update`` and ``attend`` again, in the chunks they came in (the
last one cut), leaving the layer exactly as if the dropped tokens had never arrived; ``crop(0)`` drops the record.

While recording, a multi-token chunk after the prompt that the layer does not hold dense is attended a token at a
time (hfkv.attention.interface steps through it): a verification forward then reads and changes the cache as the
single-token steps of greedy decoding would, so assisted decoding gives greedy's tokens with a compressing cache
too. Costs: one copy of the layer per verification round, and the verification chunk's Python loop over its few
tokens. Nothing is recorded unless recording was asked for; setting ``record_past = False`` (as ``generate`` does
when it hands the cache back) drops the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hfkv.layer import state
from hfkv.layer.handoff import set_pending
from hfkv.layer.masks import mask_rows


@dataclass
class _Chunk:
    """A chunk as it arrived: its keys and values (before any rotation), the logical position of its first token,
    and what its attention call passed (filled by :meth:`Rollback.attended`)."""

    key: torch.Tensor
    value: torch.Tensor
    start: int
    module: Any = None
    query: torch.Tensor | None = None
    mask: Any = None
    scaling: float = 1.0


class Rollback:
    """The past record of one layer (``layer``: the TriStateLayer)."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.recording = False
        self.replaying = False
        self.snapshot: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None  # None: the layer was empty
        self.chunks: list[_Chunk] = []
        self.stepped: tuple[torch.Tensor, torch.Tensor] | None = None  # a chunk to attend a token at a time

    def holds(self) -> bool:
        """Whether anything arrived since the record began (a crop can reach back to its start)."""
        return bool(self.chunks)

    def tokens(self) -> int:
        return sum(chunk.key.shape[2] for chunk in self.chunks)

    def drop(self) -> None:
        self.snapshot, self.chunks, self.stepped = None, [], None

    def steps_through(self, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether update() should leave this chunk to be attended a token at a time (module doc), and if so keep it."""
        layer = self.layer
        if not self.recording or self.replaying or key.shape[2] == 1 or not layer.is_initialized:
            return False
        if layer.length == 0 or layer._stays_dense(key.shape[2]):
            return False  # a prompt (greedy's prefill takes it whole too), or a chunk held as DynamicCache holds it
        self.stepped = (key, value)
        return True

    def take_stepped(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        stepped, self.stepped = self.stepped, None
        return stepped

    def arrived(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """update() took a chunk: begin the record with a copy of the layer where this is its first chunk."""
        if not self.recording or self.replaying:
            return
        layer = self.layer
        if not self.chunks:
            if layer.is_initialized and layer.length > 0:
                tensors, values = state.capture(layer)
                self.snapshot = ({name: t.clone() for name, t in tensors.items()}, values)
            else:
                self.snapshot = None
        self.chunks.append(_Chunk(key, value, layer.length))

    def attended(self, module, query: torch.Tensor, mask, scaling: float) -> None:
        """attend() was called for the last chunk: keep what it was called with, to call it so again."""
        if not self.recording or self.replaying or not self.chunks or self.chunks[-1].query is not None:
            return
        chunk = self.chunks[-1]
        chunk.module, chunk.query, chunk.mask, chunk.scaling = module, query, mask, scaling

    def crop(self, n: int) -> bool:
        """Drop the last ``n`` recorded tokens exactly (module doc); ``n == 0`` ends the record. Returns False where
        ``n`` reaches past the record's start (the caller decides), having changed nothing."""
        total = self.tokens()
        if n > total:
            return False
        if n > 0:
            chunks, self.chunks = self.chunks, []
            self._restore()
            self._replay(chunks, total - n)
        self.drop()
        return True

    def _restore(self) -> None:
        layer, snapshot = self.layer, self.snapshot
        layer.reset()  # which drops the record (its chunks were taken first)
        if snapshot is not None:
            tensors, values = snapshot
            state.restore(layer, tensors, values, layer.device)
            layer.cursor.next = None  # the device step is set from the host again

    def _replay(self, chunks: list[_Chunk], keep: int) -> None:
        layer = self.layer
        self.replaying = True
        try:
            for chunk in chunks:
                m = min(keep, chunk.key.shape[2])
                if m == 0:
                    break
                keep -= m
                if chunk.query is None:
                    raise RuntimeError(
                        f"hfkv: layer {layer.layer_idx} was cropped between a chunk's update() and its attention call"
                    )
                layer.update(chunk.key[:, :, :m], chunk.value[:, :, :m])
                set_pending(None)
                mask = mask_rows(chunk.mask, 0, m, chunk.start + m)
                layer.attend(chunk.module, chunk.query[:, :, :m], None, None, mask, chunk.scaling)
        finally:
            self.replaying = False
