"""Attention over what a layer holds (after its prompt): the window ring, a chunk's exits and every tier's slots.

Why a part of its own: after the prompt a layer's keys and values are not one tensor but a ring, the exits a
multi-token chunk pushed out, and paged records in up to three formats. Reading them is either the torch path
(records decoded, one masked attention, the scores each slot received added back; ``hfkv.kernels.slots``) or the
backend's paged decode kernel (``BackendOps.decode``: Triton or the CPU kernel), which needs a launch plan per
storage. Building that plan costs more than a decode step, so it is kept with a signature of the storage it was
made for and rebuilt only when a policy run, a grown table or pool, or a new query shape changes it; a CUDA graph
of a step stays valid while the plan does (``launch_signature``, ``plan_kept``: hfkv.graphs). A chunk too large
for one call's logits goes through in query tiles. Every path adds the scores the queries gave the slots, which
the policy reads, and hands a chunk's exits to the policy runner once their scores are in.
"""

from __future__ import annotations

import torch

from hfkv.kernels.parts import DenseSlots, PagedSlots, plan_key
from hfkv.kernels.slots import slot_attention_received


class Reads:
    """The attention reads of one layer (``layer``: the TriStateLayer) and its kept launch plan."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.plan = None  # the decode kernel's launch plan (BackendOps.decode.plan)
        self.plan_sig = None  # the storage it was made for (a signature of its tensors), None: found by key only
        self.plan_parts = None  # the storage parts it was made with

    def reset(self) -> None:
        self.plan, self.plan_sig, self.plan_parts = None, None, None

    def signature(self) -> tuple:
        """The launch plan (compare it by identity) and the storage it was made for."""
        return self.plan, self.plan_sig

    def kept(self) -> bool:
        """Whether the last step's launch plan (built for the storage as it is now) serves the next step."""
        return self.plan is not None and self.plan_sig is not None

    def attend(self, query, mask, scaling: float, exits: tuple | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``query`` over every held slot (and ``exits``, a chunk's: then the policy runs on them)."""
        if self.layer.ops.decode is not None:  # Triton, or the CPU kernel (decode steps and prefill chunks alike)
            if torch.compiler.is_compiling():
                return self._attend_traced(query, scaling)
            return self._attend_kernel(query, scaling, exits, out)
        return self._attend_torch(query, mask, scaling, exits)

    def _attend_torch(self, query, mask, scaling: float, exits: tuple | None) -> torch.Tensor:
        layer = self.layer
        win, tiers = layer.window, layer.tiers
        bsz, heads = win.k.shape[:2]
        parts, tags, sizes = [(win.k, win.v)], [(win.pos + 1).to(torch.int32).expand(bsz, heads, -1)], [win.capacity]
        if exits is not None:
            parts.append((exits[0], exits[1]))
            tags.append((exits[2] + 1).to(torch.int32).expand(bsz, heads, -1))
            sizes.append(exits[2].numel())
        for tier, lay in enumerate(layer.layouts):
            rec, tag = tiers.read_slots(tier)  # whole pages; empty slots have tag 0 and decode finite
            if rec.shape[2]:  # an empty tier (evict below budget, nothing quantized yet) costs nothing
                parts.append(lay.decode_kv_for_attention(rec))
                tags.append(tag)
            sizes.append(rec.shape[2])
        # A slot's tag (position + 1, 0 = empty) is its column in the logical mask: no index to build.
        slot_index = torch.cat(tags, -1)
        q = query.shape[2]
        # mask None: plain causal in logical coordinates, compared from the slots' positions
        out, received = slot_attention_received(
            query, parts, slot_index, mask, scaling, layer.cfg.score_reduction, q_start=layer.length - q
        )
        if layer.retention.active:  # the fields hold the gates' values: nothing is added to them
            if exits is not None:
                layer.policy.run(exits)
            return out
        w_delta, *rest = torch.split(received, sizes, dim=-1)
        win.add_scores(w_delta)
        if exits is not None:
            exit_delta, *rest = rest
            exits = (*exits[:3], exits[3] + exit_delta)
        for tier, d in enumerate(rest):
            if d.shape[-1]:  # straight into the pages' score regions: masked slots received exact zeros
                tiers.add_scores(tier, d)
        if exits is not None:
            layer.policy.run(exits)
        return out

    def _attend_kernel(self, query, scaling: float, exits: tuple | None, out: torch.Tensor | None) -> torch.Tensor:
        """The same attention through the paged kernels (Triton, or the CPU kernel): records are read and
        dequantized where they lie, scores are added in place, and the mask comes from slot positions
        (causal + left padding)."""
        layer = self.layer
        decode = layer.ops.decode
        win, tiers = layer.window, layer.tiers
        write = win.pending if layer.ops.deferred_window_write else None
        if write is None:
            win.flush()
        q = query.shape[2]
        # Between policy runs a step's storage is the tensors of the last one: a signature of them (ids
        # and shapes, what plan_key holds) finds the kept plan without building the parts and their key.
        sig = None
        if exits is None:
            sig = (query.shape, query.dtype, query.device, write is not None, *map(id, win.raw()),
                   id(tiers.pool.data), tiers.pool.data.shape, *((id(t), t.shape) for t in tiers.tables))  # fmt: skip
        if sig is not None and self.plan is not None and self.plan_sig == sig:
            parts = self.plan_parts
        else:
            parts = [DenseSlots(*win.raw())]
            if exits is not None:
                exits = (*exits[:3], exits[3].contiguous().float())
                parts.append(DenseSlots(*exits))
            parts += [
                PagedSlots(tiers.pool.data, tiers.tables[t], tiers.tpp[t], lay) for t, lay in enumerate(layer.layouts)
            ]
            tile = decode.tile(query, parts) if q > 1 else None
            if tile is not None and tile < q:
                return self._attend_tiles(decode, query, parts, tile, scaling, exits)
            # The launch plan depends only on the storage's tensors: it is rebuilt when a policy run, a
            # grown table or pool, or a new query shape changes them, not every step.
            key = plan_key(query, parts, write is not None)
            if self.plan is None or self.plan.key != key or not isinstance(self.plan, decode.plan_type):
                self.plan = decode.plan(query, parts, layer.padding.pad_end, layer.cfg.score_reduction,
                                        write is not None, add_scores=not layer.retention.active)  # fmt: skip
            self.plan_sig, self.plan_parts = sig, parts
        step = layer.cursor.device_step(write) if write is not None else None
        out = decode.run(self.plan, query, parts, layer.length - q, layer.padding.pad_end, scaling,
                         layer.cfg.score_reduction, write, step, out)  # fmt: skip
        if write is not None:
            win.pending = None  # the kernel wrote it
            layer.policy.prepare_ahead()
        if exits is not None:
            layer.policy.run(exits)
        return out

    def _attend_traced(self, query, scaling: float) -> torch.Tensor:
        """A one-token step under torch.compile (``TriStateLayer.step_traces``: no chunk, no policy run): the
        kernel's traced call on the parts as they are, with no plan kept by identity (Dynamo guards on none)."""
        layer = self.layer
        win, tiers = layer.window, layer.tiers
        win.flush()
        parts = [DenseSlots(*win.raw())]
        parts += [PagedSlots(tiers.pool.data, table, tpp, lay)
                  for table, tpp, lay in zip(tiers.tables, tiers.tpp, layer.layouts, strict=True)]  # fmt: skip
        return layer.ops.decode.traced(query, parts, layer.length - query.shape[2], layer.padding.pad_end, scaling,
                                       layer.cfg.score_reduction)  # fmt: skip

    def _attend_tiles(self, decode, query, parts, tile: int, scaling: float, exits: tuple | None) -> torch.Tensor:
        """A chunk's attention in query tiles of ``tile`` queries (``CHUNK_LOGITS_BYTES``): each tile's softmax
        is whole (every slot is read for it), and the scores each tile adds to the slots sum to the chunk's."""
        layer = self.layer
        q = query.shape[2]
        outs = []
        for t0 in range(0, q, tile):
            part_q = query[:, :, t0 : t0 + tile]
            outs.append(decode.attention(part_q, parts, layer.length - q + t0, layer.padding.pad_end, scaling,
                                         layer.cfg.score_reduction, not layer.retention.active))  # fmt: skip
        self.plan_sig = None  # as after an untiled chunk: the next step finds no kept plan by signature
        if exits is not None:
            layer.policy.run(exits)
        return torch.cat(outs, dim=1)
