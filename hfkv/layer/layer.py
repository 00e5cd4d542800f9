"""TriStateLayer: one compressed model layer's cache, a thin container in the spirit of transformers' DynamicLayer.

The layer keeps the state every part shares (its config, length, window ring, paged tiers, record layouts and
backend operations) and answers transformers' cache-layer protocol (``update``, ``get_seq_length``,
``get_mask_sizes``, batch surgery, ``reset``) and hfkv's attention function (``attend``). Each other job is a part
with its own state, holding a reference to the layer for what they share:

- ``dense`` (:mod:`hfkv.layer.dense`): the sequence held as DynamicCache holds it while the budget keeps it exact;
- ``budget`` (:mod:`hfkv.layer.budget`): costs, room and the host-side budget questions;
- ``padding`` (:mod:`hfkv.layer.padding`): the rows' left padding and sinks;
- ``policy`` (:mod:`hfkv.layer.policy_runner`): when the policy runs, a run, and a run prepared a step ahead;
- ``moves`` (:mod:`hfkv.storage.moves`): tokens written to, moved between and dropped from the tiers;
- ``reads`` (:mod:`hfkv.layer.reads`): attention over the held slots and the kept launch plan;
- ``cursor`` (:mod:`hfkv.layer.step_cursor`): the device-side step a CUDA graph replays;
- ``rollback`` (:mod:`hfkv.layer.rollback`): the past record that lets ``crop`` undo a forward exactly;
- :mod:`hfkv.layer.prefill` and :mod:`hfkv.layer.introspection`: a prompt's admission, and what the layer holds.

What it needs of its cache is :class:`hfkv.layer.owner.LayerOwner` (the layer sits below ``hfkv.cache``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from hfkv.kernels.backend import backend_ops, resolve_backend
from hfkv.layer import introspection, prefill
from hfkv.layer.budget import Budget
from hfkv.layer.dense import DensePhase
from hfkv.layer.handoff import pending, set_pending
from hfkv.layer.masks import logical_mask
from hfkv.layer.offload import Offload
from hfkv.layer.owner import LayerOwner
from hfkv.layer.padding import Padding
from hfkv.layer.policy_runner import PolicyRunner
from hfkv.layer.reads import Reads
from hfkv.layer.retention import Retention
from hfkv.layer.rollback import Rollback
from hfkv.layer.step_cursor import StepCursor
from hfkv.quant.formats import QuantFormat
from hfkv.quant.record import RecordLayout
from hfkv.quant.rotation import hadamard, rotate
from hfkv.states import TIER_NAMES
from hfkv.stats import LayerStats
from hfkv.storage import PagedTiers, WindowRing
from hfkv.storage.moves import Moves
from hfkv.storage.pool import GROWTH


class TriStateLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, cache: LayerOwner, layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.cfg = cache.config
        self.layer_idx = layer_idx
        self.length = 0  # logical: every token seen, padding included
        self.window: WindowRing | None = None
        self.tiers: PagedTiers | None = None
        self.score_start = 0  # logical position of the first query whose attention was observed
        self.oq: torch.Tensor | None = None  # [B] this layer's OQ score from prefill
        # cfg.rotate: the orthonormal Hadamard matrix every key, value and query of this layer is rotated by
        # (hfkv.quant.rotation), set with the layer's shapes; None: nothing is rotated.
        self.rotation: torch.Tensor | None = None
        # update()'s keys, values and start, for attend() (the prompt's are attended densely)
        self._chunk: tuple[torch.Tensor, torch.Tensor, int] | None = None
        # Tokens a multi-token chunk pushed out of the window: attended densely by the chunk's queries,
        # classified (with those scores) right after, so they are written once, to the tier they end in.
        self._exits: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.padding = Padding(self)
        self.dense = DensePhase(self)
        self.policy = PolicyRunner(self)
        self.reads = Reads(self)
        self.cursor = StepCursor(self)
        self.offloaded = Offload(self)
        self.rollback = Rollback(self)
        self.retention = Retention(self)  # score_source="retention": each token's learned retention
        self.budget: Budget | None = None  # made for the layer's shapes (lazy_initialization)
        self.moves: Moves | None = None  # with the window and tiers (build_storage), once the layer compresses

    def __repr__(self) -> str:
        return introspection.describe(self)

    # ------------------------------------------------------------ set-up
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bsz, heads, _, dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        cfg = self.cfg
        self.backend = resolve_backend(cfg.backend, self.device)
        self.ops = backend_ops(self.backend)
        self.rotation = hadamard(dim, self.device) if cfg.rotate else None

        def layout(name: str) -> RecordLayout:
            if name == "mid" and not cfg.uses_mid_tier():
                name = "original"  # an empty tier: never written, so its layout only has to be valid
            tier, group = getattr(cfg, name), cfg.group_for(name, dim)
            try:
                key = QuantFormat(tier.key, dim, group, self.dtype)
                value = QuantFormat(tier.value, dim, group, self.dtype)
            except ValueError:
                if name != "quantized" or cfg.uses_quantized_tier():
                    raise
                return layout("original")  # never written (evict, streaming): any valid layout, e.g. 1-wide heads
            return RecordLayout(key, value)

        self.layouts = tuple(layout(name) for name in TIER_NAMES)  # indexed by state
        self.kv_shape = (bsz, heads, dim)  # rows, KV heads, head dim: what the storage is built for
        self.budget = Budget(self, dim)
        gates, kind = None, "retention"
        if cfg.score_source == "retention":
            gates, kind = self.cache.retention_gates(self.layer_idx, heads, dim)
        self.retention.initialize(gates, kind, self.device)
        self.policy.initialize(next(i for i, layer in enumerate(self.cache.compressed_layers()) if layer is self))
        self.is_initialized = True

    def build_storage(self) -> None:
        """The window ring and paged tiers, made when the layer first holds a token compressed: a first chunk the
        budget cannot keep exact, or the chunk that takes a dense sequence past it (:mod:`hfkv.layer.dense`)."""
        bsz, heads, dim = self.kv_shape
        cfg = self.cfg
        self.window = WindowRing(bsz, heads, cfg.window, dim, self.dtype, self.device, extra=cfg.interval)
        # A budget bounds the pool, so it grows by exact demand (capacity never above the peak).
        growth = 0.0 if cfg.budget is not None else GROWTH
        self.tiers = PagedTiers(self.layouts, bsz, heads, cfg.page_bytes, self.device, growth=growth, ops=self.ops)
        self.moves = Moves(self.tiers)

    def begin(self, first: int) -> None:
        """An empty layer's first chunk of ``first`` tokens: held dense while the budget keeps it exact, else stored."""
        if self.budget.share is None:
            raise RuntimeError(
                f"layer {self.layer_idx}: TriStateConfig.layer_adaptive=True shares the room by every layer's scores "
                "of a context scored whole, which a forward filling the layers one at a time cannot give: fill the "
                "cache with hfkv.compress(model, input_ids, config) (scores='reconstruction'), or set "
                "layer_adaptive=False"
            )
        self.dense.active = self.dense.eligible() and self.dense.fits(first)
        if not self.dense.active and self.window is None:
            self.build_storage()

    # ------------------------------------------------------ Cache protocol
    # ``keys`` / ``values``: DynamicLayer's ``[B, H, T, D]`` tensors, for code written for DynamicCache (shapes, dtypes,
    # a look at the values). While the layer holds its sequence dense they are its tensors; once it is stored in the
    # window and tiers, a copy built on each read (introspection.held_kv: dequantized, evicted positions zero), not
    # part of what the cache holds. Read-only: CacheLayerMixin's constructor sets them to None.
    @property
    def keys(self) -> torch.Tensor | None:
        return self._held(0)

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("TriStateLayer.keys is read-only: what the layer holds is its own")

    @property
    def values(self) -> torch.Tensor | None:
        return self._held(1)

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("TriStateLayer.values is read-only: what the layer holds is its own")

    def _held(self, which: int) -> torch.Tensor | None:
        if self.dense.active:
            return (self.dense.k, self.dense.v)[which]
        if not self.is_initialized:
            return None
        if self._chunk is not None:
            raise RuntimeError(
                f"hfkv: layer {self.layer_idx} stores tokens compressed and its last update() was not followed by "
                "an attention call, which places and scores them: read keys and values after the attention call"
            )
        return introspection.held_kv(self)[which]

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Called once per forward before any layer runs: a forward that raised half-way must not leave its pending
        # layer behind for this one. The mask itself is whichever the model's attention implementation builds
        # (hfkv.layer.masks reads each form), so asking for sizes leaves nothing behind for a later forward.
        set_pending(None)
        return self.length + query_length, 0

    def _stays_dense(self, query_length: int) -> bool:
        """Whether the next chunk of ``query_length`` tokens is held dense, and so attended as DynamicCache would be
        (with its mask: where plain causal, none)."""
        return self.dense.active and self.dense.fits(self.length + query_length)

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can put the layer back as it was: while it holds its sequence dense (every token
        exact, nothing scored into a decision yet), as DynamicLayer does, and while it records its past
        (:meth:`activate_past_recording`) back to where the record began."""
        return not self.is_initialized or self.dense.active or self.rollback.recording

    def activate_past_recording(self) -> None:
        """What transformers' ``Cache.activate_past_recording()`` calls before assisted decoding: from now on a
        crop puts the layer back exactly (hfkv.layer.rollback)."""
        self.rollback.recording = True

    @property
    def record_past(self) -> bool:
        return self.rollback.recording

    @record_past.setter
    def record_past(self, on: bool) -> None:  # generate() sets it False when it hands the cache back
        self.rollback.recording = bool(on)
        if not on:
            self.rollback.drop()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (assisted and prompt-lookup decoding reject candidates so):
        exactly, back to where the past record began (hfkv.layer.rollback; ``crop(0)`` ends the record); else as
        DynamicLayer does while the layer is dense; once it stores tokens compressed and records nothing, raise:
        evicted and quantized tokens cannot be restored, and the window's last tokens would leave holes in its ring."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"TriStateCache.crop({tokens_to_remove}): pass a negative number of tokens to remove, as DynamicCache "
                "takes it"
            )
        n = -tokens_to_remove
        if self.rollback.holds() and self.rollback.crop(n):
            return
        if n == 0 or not self.is_initialized:
            return
        if not self.dense.active:
            recorded = (
                f"it recorded only its last {self.rollback.tokens()} tokens"
                if self.rollback.recording
                else "it records no past (cache.activate_past_recording(), as assisted decoding calls it)"
            )
            raise ValueError(
                f"TriStateCache cannot be cropped by {n} tokens: layer {self.layer_idx} holds {self.length} tokens "
                f"compressed (past its budget) and {recorded}; evicted and quantized tokens cannot be restored. Call "
                "activate_past_recording() before the forwards a crop must undo, or use the 'full' preset or "
                "DynamicCache."
            )
        self.rollback.drop()  # a crop past the record's start: the record no longer describes the layer
        self.dense.crop(n)
        self.length -= n

    def offload(self) -> None:
        """``offloading=True``: the storage goes to host memory once this step's attention has read it."""
        self.offloaded.request()

    def prefetch(self) -> None:
        """``offloading=True``: the storage back on the layer's device (on the cache's prefetch stream)."""
        self.offloaded.prefetch()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        stale = pending()
        if stale is not None and stale.attends_densely():
            # Its keys and values were taken as DynamicCache takes them (code that calls update() alone, as
            # transformers' own cache tests do); only that chunk's queries are not in its scores.
            set_pending(None)
        elif stale is not None:
            shape = self.cache.model_shape
            built = f" (built for {shape.describe()})" if shape is not None else ""
            raise RuntimeError(
                f"hfkv: a cache layer's update() was not followed by an attention call: the model using this cache"
                f"{built} looks its attention function up without transformers' ALL_ATTENTION_FUNCTIONS."
                "get_interface, so compressed tokens would be ignored, or its attention does not call "
                "past_key_values.update with standard K/V (a layer storing tokens compressed scores them in the "
                "attention call after each update)."
            )
        if self.rollback.steps_through(key_states, value_states):
            set_pending(self)  # the dispatch attends it a token at a time, each through update() again
            return key_states, value_states
        self.rollback.arrived(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.offloaded.prefetch()  # where the cache's prefetch did not (it does before each update)
        q = key_states.shape[2]
        if self.length == 0:
            self.begin(q)
        self.retention.read(key_states, value_states)
        if self.dense.active:
            if self._stays_dense(q):
                keys, values = self.dense.append(key_states, value_states)
                self.length += q
                set_pending(self)
                return keys, values
            self.dense.leave()  # this chunk outgrows the budget: the sequence so far goes to the window and tiers
        if self.rotation is not None:  # stored rotated; attend() rotates the query alike and its output back
            key_states, value_states = rotate(key_states, self.rotation), rotate(value_states, self.rotation)
        self._chunk = (key_states, value_states, self.length)
        if self.length > 0:
            # Triton writes a decode step's token into the ring in its attention launch (push_deferred).
            slot = None
            score = self.retention.take() if self.retention.active else None  # the tokens' fields (else 0)
            if self.ops.deferred_window_write and q == 1:
                slot = self.window.push_deferred(key_states, value_states, self.length, score)
            if slot is not None:
                self._exits = None
            else:
                exits = self.window.push(key_states, value_states, self.length, score)
                self._exits = exits if exits[2].numel() else None
        self.length += q
        if self.length > q and self._exits is None:
            self.policy.step()
        set_pending(self)
        return key_states, value_states

    # ------------------------------------------------------------ attention
    def take_stepped(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The chunk update() left to be attended a token at a time (hfkv.layer.rollback), or None."""
        return self.rollback.take_stepped()

    def attends_densely(self) -> bool:
        """Whether update() held this chunk dense: the model's own attention over the keys and values update()
        returned is then DynamicCache's, bit for bit, and :meth:`attend` only observes (``computed``)."""
        return self.dense.active

    def attend(self, module, query, key, value, mask, scaling: float, out: torch.Tensor | None = None,
               computed: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Called by the attention dispatch right after this layer's update(), with the mask the model's
        implementation built (any form: hfkv.layer.masks). ``out``: the tensor to write the result to (hfkv.graphs:
        where a replayed graph reads it), one this layer's attention returned for the same query shape; a Triton
        decode step writes it in place, any other path copies. ``computed``: a dense chunk's output, which the
        model's own attention computed (the dispatch); without it, SDPA computes it."""
        self.rollback.attended(module, query, mask, scaling)
        mask = logical_mask(mask, query.shape[2])
        if self.dense.active:  # update() held this chunk dense (the keys and values are never rotated there)
            res = self.dense.attend(module, query, mask, scaling, computed)
            res = res if out is None else out.copy_(res)
        else:
            res = self._attend_stored(module, query, mask, scaling, out)
        self.offloaded.after_attend()
        return res

    def _attend_stored(self, module, query, mask, scaling: float, out: torch.Tensor | None) -> torch.Tensor:
        if self.rotation is not None:  # (Hq).(Hk) = q.k: the keys and values were stored rotated (update())
            query = rotate(query, self.rotation)
        (k, v, _), self._chunk = self._chunk, None
        exits, self._exits = self._exits, None
        if self.length == k.shape[2]:
            res = prefill.attend_prompt(self, module, query, k, v, mask, scaling)
        else:
            res = self.reads.attend(query, mask, scaling, exits, out)
        if self.rotation is not None:  # sum p (Hv) = H (sum p v): rotated back (H is its own inverse)
            res = rotate(res, self.rotation)
        if out is None or res is out:
            return res
        return out.copy_(res)

    def attention_weights(self, query: torch.Tensor, mask, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``output_attentions`` returns for this chunk, asked for before :meth:`attend` (which takes the chunk):
        ``[B, Hq, q, logical length]``, zero where a token is not held, and the values they weigh
        (introspection.attention_weights)."""
        return introspection.attention_weights(self, query, logical_mask(mask, query.shape[2]), scaling)

    def ingest_prefill(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
        scaling: float,
        scores: torch.Tensor | None = None,
        room_share: float | None = None,
    ) -> None:
        """Fill an empty layer from a prompt's keys/values ``[B, H, T, D]`` (after RoPE) and its last queries
        ``[B, Hq, w', D]`` (``w' >= obs_window`` of the prompt's final positions; plain causal, no padding),
        leaving it exactly as a prefill forward through this cache would.

        Why: the prompt's attention output does not depend on the cache (prefill is dense), so an evaluation
        that compares many caches on one long prompt runs the model over it once and fills each cache from
        the captured tensors (``hfkv.evaluation.shared_prefill``). ``scores [B, H, T]``: each token's importance from
        another source than the observation window (``hfkv.compress``: a context scored before any question), in
        place of the window's, scaled to their total (``prefill.in_scale``). ``room_share``: the layer's room outside
        the window as a multiple of an even split's (``TriStateConfig.layer_adaptive``; ``hfkv.policy.layer_shares``).
        """
        prefill.ingest(self, key, value, query, scaling, scores, room_share)

    # ------------------------------------------------------------ policy runs and CUDA graphs
    def run_policy(self, exits: tuple[torch.Tensor, ...] | None = None) -> None:
        """Run the policy now (``exits``: a chunk's window exits), as a step that is due runs it (PolicyRunner.run)."""
        self.policy.run(exits)

    @property
    def steps_since_policy(self) -> int:
        return self.policy.steps

    @steps_since_policy.setter
    def steps_since_policy(self, steps: int) -> None:
        self.policy.steps = steps

    @property
    def policy_runs(self) -> int:
        """Every policy run of the layer: what a benchmark compares ``runs_ahead`` with."""
        return self.policy.runs

    @property
    def runs_ahead(self) -> int:
        """Policy runs finished from a plan prepared a step ahead."""
        return self.policy.runs_ahead

    @property
    def step_fills(self) -> int:
        """How many times the device step was set from the host (hfkv.graphs checks it)."""
        return self.cursor.fills

    def decode_steps_before_policy(self, limit: int = 4096) -> int:
        """How many of the next one-token steps run no policy run (at most ``limit``): the steps a CUDA graph of
        one of them can replay (hfkv.graphs); none while recording the past (each update is recorded)."""
        if self.rollback.recording or self.retention.active:  # no graph captures the gates' field writes yet
            return 0
        return self.policy.steps_before(limit)

    def replayed_step(self, checked: bool = True) -> None:
        """The host side of a one-token step whose launches a CUDA graph replayed: what update() and attend()
        change on the host for a step between policy runs. ``checked=False``: the caller counted the policy-free
        steps already."""
        self.cursor.replayed(checked)

    def step_traces(self, query_length: int) -> bool:
        """Whether Dynamo can trace this layer's next step of ``query_length`` tokens (hfkv.compiled): one token,
        held dense and staying so, or stored on a backend of torch ops with no policy run due."""
        if query_length != 1 or not self.is_initialized or self.length == 0 or self.rollback.recording:
            return False
        if self.retention.active:  # its gates' ops and the field writes of update() are not traced yet
            return False
        if self.dense.active:
            return self._stays_dense(1)
        return self.ops.traced_steps and self.policy.steps_before(1) >= 1

    def launch_signature(self) -> tuple:
        """What this layer's decode launches depend on: the launch plan (compare it by identity) and the storage
        it was made for. A policy run that grows or shrinks no table and no pool leaves both as they were, so
        a CUDA graph captured before the run replays after it (hfkv.graphs)."""
        return self.reads.signature()

    def plan_kept(self) -> bool:
        """Whether the last step's decode launch plan (built and compiled for the storage as it is now) serves
        the next step: no policy run or chunk changed the storage after that step's attention (hfkv.graphs)."""
        return self.reads.kept()

    # ------------------------------------------------------- batch surgery
    def _select_rows(self, index: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        self.offloaded.prefetch()
        index = torch.as_tensor(index, dtype=torch.long).to(self.device)  # DynamicLayer takes a tuple or list too
        self.policy.ahead = None  # prepared for rows that are no longer these
        self.rollback.drop()  # recorded for those rows
        self.kv_shape = (index.numel(), *self.kv_shape[1:])
        self.dense.select_rows(index)
        if self.window is not None:
            self.window.select_rows(index)
            self.tiers.select_rows(index)
            self.budget.refresh_peak()
        self.padding.select_rows(index)
        if self.oq is not None:
            self.oq = self.oq[index]
        self.cache.invalidate_rho()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.kv_shape[0]).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices)

    def reset(self) -> None:
        self.rollback.drop()  # recording stays on, as DynamicSlidingWindowLayer's does
        if self.is_initialized:  # the next prompt decides again whether it is held dense (begin)
            self.window = self.tiers = self.moves = None
            self.dense.reset()
            self.budget.tier_peak = 0
        self.reads.reset()
        self.policy.reset()
        self.offloaded.reset()
        self.length, self.score_start = 0, 0
        self.padding.reset()
        self.oq = None
        self.cache.invalidate_rho()

    # ------------------------------------------------------------- what it holds
    def held_tensors(self) -> list[torch.Tensor]:
        return introspection.held_tensors(self)

    def token_states(self) -> torch.Tensor:
        """``[B, H, logical length]`` int8 state of every logical position (``hfkv.states``; WINDOW = -1)."""
        return introspection.token_states(self)

    def token_scores(self) -> torch.Tensor:
        """``[B, H, logical length]`` fp32 significance the policy sees for every held token (NaN: evicted)."""
        return introspection.token_scores(self)

    def layer_stats(self) -> LayerStats:
        return introspection.layer_stats(self)
