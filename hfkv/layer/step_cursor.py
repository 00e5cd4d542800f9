"""The device-side cursor of a layer's decode steps: where the next step's token goes, kept on the GPU.

Why a part of its own: a Triton decode step reads its logical position and ring slot from a small device tensor
(``[position, slot]``, advanced by its own launches) instead of taking them as launch arguments, so consecutive
steps launch with the same arguments and a CUDA graph of one replays the next (hfkv.graphs). The host keeps its
copy of what the device holds for the next step; only where a step's write is not that (the first step, one after
a token a tensor op wrote, a rewound ring) does it set the device from the host (``fills`` counts those, which
hfkv.graphs checks: a fill captured in a graph would rewind every replay). A replayed step's host bookkeeping is
here too: what update() and attend() would have changed on the host for a step between policy runs.
"""

from __future__ import annotations

import torch


class StepCursor:
    """The step cursor of one layer (``layer``: the TriStateLayer, whose window, length and policy runner it moves)."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.dev: torch.Tensor | None = None  # [position, slot] of the next step's ring write, on the device
        self.next: tuple[int, int] | None = None  # the host's copy of what the device holds for the next step
        self.fills = 0  # how many times the device step was set from the host

    def device_step(self, write) -> torch.Tensor:
        """The device ``[position, slot]`` of this step's ring write (``write``: the window's pending write), set
        from the host only where it is not already there (run_plan's ``step``)."""
        if self.dev is None:
            self.dev = torch.zeros(2, dtype=torch.int64, device=self.layer.device)
        if self.next != (write.pos, write.slot):
            self.set(write.pos, write.slot)
        self.next = (write.pos + 1, (write.slot + 1) % self.layer.window.capacity)
        return self.dev

    def set(self, pos: int, slot: int) -> None:
        """Set the device step from the host (a rewound ring's next token, or a write the device does not hold)."""
        # fill_ takes the numbers as launch arguments: no host-to-device copy, nothing waits
        self.dev[0:1].fill_(pos)
        self.dev[1:2].fill_(slot)
        self.next = (pos, slot)
        self.fills += 1

    def replayed(self, checked: bool = True) -> None:
        """The host side of a one-token step whose launches a CUDA graph replayed: the window took the token, which
        the kernel wrote, and the device step advanced. ``checked=False``: the caller counted the policy-free steps
        already."""
        layer = self.layer
        if checked and (self.next is None or layer.window.pending is not None or layer.policy.steps_before(1) < 1):
            raise RuntimeError(
                f"hfkv: layer {layer.layer_idx} cannot take a replayed step here (one runs the policy, or no "
                "Triton decode step ran since the last change of the ring)"
            )
        pos, slot = self.next
        layer.window.count += 1
        layer.length += 1
        layer.policy.steps += 1
        self.next = (pos + 1, (slot + 1) % layer.window.capacity)
        layer.policy.prepare_ahead()  # as attend() does: the next step's run, where it is due, from what the graph left
