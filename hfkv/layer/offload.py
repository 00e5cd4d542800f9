"""A compressing layer's storage in host memory between its attention calls (``offloading=True``, as DynamicCache's).

Why a part of its own: transformers' ``Cache.update`` offloads a layer right after its ``update()`` and prefetches the
next layer on a side stream; a DynamicLayer's attention reads the tensors ``update()`` returned, so that is safe.
A compressing layer's attention reads its storage (ring, pages), so here an offload request waits for the end of
``attend()``; the cache's prefetch of this layer (made during the previous layer's update) brings the storage back
before its next ``update()``, and any other entry (row selection, reset) brings it back first.

What moves is the bulk that grows with the sequence: a dense layer's keys and values, the ring's keys and values, and
the page pool. Tables, tags and score sums are a few bytes a token and stay. A kept launch plan and a plan prepared
a step ahead describe the tensors as they were: both are dropped.
"""

from __future__ import annotations

import torch

HOST = torch.device("cpu")


class Offload:
    """Whether one layer's storage is on the host (``layer``: the TriStateLayer), and its moves."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.requested = False  # offload() came during update(): move after attend()
        self.on_host = False
        self.moves = 0  # to the host and back, each counts (tests, benchmarks)

    def request(self) -> None:
        if self.layer.is_initialized:
            self.requested = True

    def after_attend(self) -> None:
        if self.requested:
            self.requested = False
            self._move(HOST)
            self.on_host = True

    def prefetch(self) -> None:
        """Bring the storage back to the layer's device (a no-op where it is there)."""
        if self.on_host:
            self._move(self.layer.device)
            self.on_host = False

    def reset(self) -> None:
        self.requested = self.on_host = False

    def _move(self, device: torch.device) -> None:
        layer = self.layer
        blocking = device.type == "cpu" and layer.device.type == "cpu"

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=not blocking)

        dense = layer.dense
        dense.k, dense.v = move(dense.k), move(dense.v)
        if layer.window is not None:
            ring = layer.window
            ring.flush()
            ring._k, ring._v = move(ring._k), move(ring._v)
            ring._empty = ring.empties()  # on the device the ring is now on
            layer.tiers.pool.data = move(layer.tiers.pool.data)
        layer.reads.reset()
        layer.policy.ahead = None
        self.moves += 1
