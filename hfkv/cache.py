"""TriStateCache: a DynamicCache whose full-attention layers keep tokens original, quantized or evicted.

One ``TriStateLayer`` per compressed model layer owns a dense window ring and paged tiers (see
``hfkv.storage``); the container only builds layers, resolves per-layer settings and shares the
per-layer OQ ratios, in the spirit of transformers' ``cache_utils`` (one object per layer, a thin
container).

Life of a token: it enters the window; when W newer tokens have arrived it leaves the window
into the original tier; the policy (``hfkv.policy.classify``) then keeps it, demotes it to the
quantized tier or evicts it, and may later demote or evict it further, never back.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from functools import partial
from types import ModuleType

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    DynamicCache,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from hfkv.attention.interface import NAME, enable, pending, request_logical_mask, set_pending
from hfkv.attention.slots import slot_attention_received
from hfkv.config import TriStateConfig
from hfkv.kernels.backend import resolve_backend
from hfkv.kernels.parts import DenseSlots, PagedSlots, plan_key
from hfkv.model_shape import ModelShape
from hfkv.policy import (
    classify,
    observation_probs,
    oq_ratios,
    oq_score,
    oq_score_from_mass,
    smooth_scores,
    token_scores,
)
from hfkv.policy.budget import allocate
from hfkv.policy.unified import Sinks
from hfkv.quant.fidelity import tier_fidelity
from hfkv.quant.formats import QuantFormat, check_ends
from hfkv.quant.rotation import hadamard, rotate
from hfkv.states import EVICTED, MID, ORIGINAL, QUANTIZED, TIER_NAMES, WINDOW
from hfkv.stats import CacheStats, LayerStats
from hfkv.stats_html import cache_html
from hfkv.storage import PagedTiers, RecordLayout, WindowRing, dense_kv_bytes, held_bytes
from hfkv.storage.paged import score_means
from hfkv.storage.pool import GROWTH

_UNCOMPRESSED_TYPES = ("sliding_attention", "chunked_attention")
# The Triton partial pass keeps a call's logits (4 bytes per query row and slot) for its score pass: one
# 4,096-token chunk over 6,000 slots at batch 8 and 8 KV heads x 4 would hold 25 GB (a chunked 32k prefill
# of Llama-3.1-8B ran out of memory at a third of the batch its cache would fit). Larger calls go through
# in query tiles that keep the logits under this.
CHUNK_LOGITS_BYTES = 256 * 2**20


_KERNEL_MODULES: dict[str, ModuleType] = {}


def _chunk_tile(query: torch.Tensor, parts) -> int:
    """Queries per Triton call for ``query [B, Hq, q, D]`` over ``parts`` that keep the call's logits under
    ``CHUNK_LOGITS_BYTES`` (at least one)."""
    bsz, hq = query.shape[:2]
    per_query = 4 * bsz * hq * sum(p.slots for p in parts)  # g query rows per KV head: hq rows per query
    return max(1, CHUNK_LOGITS_BYTES // max(1, per_query))


def _tier_members(new: torch.Tensor, tiers: int):
    """``(tier, (b, h, i))`` of every non-empty tier of a ``[B, H, m]`` state map, each in (b, h, i) order.

    On a GPU every ``nonzero`` waits for the device, so there the tokens are sorted by tier (stably) and the
    tier sizes read once: a prompt's tier writes waited 16 times a layer, 8 after. On a CPU the waits cost
    nothing and three ``nonzero`` take a third of the sort's time for a policy run's few exits.
    """
    return _members_by_nonzero(new, tiers) if new.device.type == "cpu" else _members_by_sort(new, tiers)


def _members_by_nonzero(new: torch.Tensor, tiers: int):
    for tier in range(tiers):
        b, h, i = (new == tier).nonzero(as_tuple=True)
        if i.numel():
            yield tier, (b, h, i)


def _members_by_sort(new: torch.Tensor, tiers: int):
    _, heads, m = new.shape
    flat = new.reshape(-1)
    sizes = (flat == torch.arange(tiers, device=flat.device, dtype=flat.dtype)[:, None]).sum(-1).tolist()
    order = torch.argsort(flat, stable=True)
    start = 0
    for tier, n in enumerate(sizes):
        if n:
            idx = order[start : start + n]
            yield tier, (idx // (heads * m), idx // m % heads, idx % m)
        start += n


def _kernel_module(backend: str) -> ModuleType:
    """The decode kernels' module for ``backend``, imported at first use (the Triton one imports triton).

    Kept as a module, not its functions, so a wrapper installed on them later (the GPU offload plugin)
    is what a step calls; a step looks it up in a dict instead of running import statements.
    """
    mod = _KERNEL_MODULES.get(backend)
    if mod is None:
        name = "hfkv.kernels.decode_attention" if backend == "triton" else "hfkv.kernels.cpu.paged_decode"
        mod = _KERNEL_MODULES[backend] = importlib.import_module(name)
    return mod


class TriStateLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cache: TriStateCache, layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.cfg = cache.config
        self.layer_idx = layer_idx
        self.length = 0  # logical: every token seen, padding included
        self.window: WindowRing | None = None
        self.tiers: PagedTiers | None = None
        self.score_start = 0  # logical position of the first query whose attention was observed
        self.pad_end: torch.Tensor | None = None  # [B] leading padding tokens per row
        # Whether some row may be left-padded (host-side: a prompt without a mask is not; else read once per
        # prefill on a CPU, assumed on a GPU): without padding every token leaving the window is real, which a
        # policy run's admission can take as it is (_admit_exits), and _nothing_competes can decide on the host.
        self._padded = True
        self._pad_max: int | None = None  # the largest row's leading padding, read when first needed (_exits_padded)
        self._exit_heads: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.sink_end: torch.Tensor | None = None  # [B] positions below this are sinks
        self.oq: torch.Tensor | None = None  # [B] this layer's OQ score from prefill
        self.steps_since_policy = 0
        self._chunk: tuple[torch.Tensor, torch.Tensor, int] | None = None
        # Tokens a multi-token chunk pushed out of the window: attended densely by the chunk's queries,
        # classified (with those scores) right after, so they are written once, to the tier they end in.
        self._exits: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # Largest tier-held count of a head (or of a row's heads with head_adaptive), kept on the host so
        # the per-step "over budget?" check needs no device sync; refreshed whenever the tiers change.
        self._tier_peak = 0
        self._cost_t: torch.Tensor | None = None  # self.cost per tier on the tiers' device (0: a tier that is off)
        self._cap_memo: tuple | None = None  # (ratios, their row's shape, heads and room, exact cap): _exact_cap
        self._plan = None  # the Triton decode kernels' launch plan (decode_attention.plan_attention)
        self._plan_sig, self._plan_parts = None, None  # the storage it was made for (_attend_slots_kernel)
        # A Triton decode step reads its position and ring slot from the device ([position, slot], advanced by
        # its own launches), so consecutive steps launch alike and a CUDA graph replays them (hfkv.graphs).
        # _step_next is the host's copy of what the device holds for the next step; where a step's write is not
        # that (the first step, one after a token a tensor op wrote) two fills set the device first.
        self._step_dev: torch.Tensor | None = None
        self._step_next: tuple[int, int] | None = None
        self.step_fills = 0  # how many times the device step was set from the host (hfkv.graphs checks it)
        self.policy_runs = 0  # every run_policy() call: what a benchmark compares runs_ahead with
        self.runs_ahead = 0  # policy runs finished from a plan prepared a step ahead (_finish_run_ahead)
        # The next step's policy run up to its host read, queued after this step's attention (_prepare_run_ahead):
        # (key, new, valid, sizes, launched, numbers), or None.
        self._ahead: tuple | None = None
        # cfg.rotate: the orthonormal Hadamard matrix every key, value and query of this layer is rotated by
        # (hfkv.quant.rotation), set with the layer's shapes; None: nothing is rotated.
        self._rot: torch.Tensor | None = None

    def __repr__(self) -> str:
        if not self.is_initialized:
            return f"TriStateLayer({self.layer_idx}, empty)"
        c = self.tiers.counts.sum((0, 1)).tolist()
        mid = f"mid={c[MID]}, " if self.cfg.uses_mid_tier() else ""
        return (
            f"TriStateLayer({self.layer_idx}, len={self.length}, window={self.window.count}, "
            f"original={c[ORIGINAL]}, {mid}quantized={c[QUANTIZED]}, backend={self.backend})"
        )

    # ------------------------------------------------------------ set-up
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bsz, heads, _, dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        cfg = self.cfg
        self.backend = resolve_backend(cfg.backend, self.device)
        self._rot = hadamard(dim, self.device) if cfg.rotate else None

        def layout(name: str) -> RecordLayout:
            if name == "mid" and not cfg.uses_mid_tier():
                name = "original"  # an empty tier: never written, so its layout only has to be valid
            tier, group = getattr(cfg, name), cfg.group_for(name, dim)
            return RecordLayout(
                QuantFormat(tier.key, dim, group, self.dtype), QuantFormat(tier.value, dim, group, self.dtype)
            )

        self.layouts = tuple(layout(name) for name in TIER_NAMES)  # indexed by state
        self.window = WindowRing(bsz, heads, cfg.window, dim, self.dtype, self.device, extra=cfg.interval)
        self._init_memory_budget(dim)
        # A budget bounds the pool, so it grows by exact demand (capacity never above the peak).
        growth = 0.0 if cfg.budget is not None else GROWTH
        self.tiers = PagedTiers(
            self.layouts, bsz, heads, cfg.page_bytes, self.device, growth=growth, backend=self.backend
        )
        self.alpha_h = self.cache.alpha_h[self.layer_idx].to(self.device)
        self.alpha_l = self.cache.alpha_l[self.layer_idx].to(self.device)
        # Host-side, once: asked at every policy run (_nothing_competes), and a device read there is a sync.
        self._has_floor = bool((self.cache.alpha_l[self.layer_idx] > 0).any())
        # stagger: the steps (lengths modulo interval) of this layer's runs, by its rank among the compressed
        # layers, so the runs spread evenly where only some layers are compressed
        rank = next(i for i, layer in enumerate(self.cache._tri_layers()) if layer is self)
        self._phase = rank % cfg.interval if cfg.stagger else 0
        self.is_initialized = True

    def _init_memory_budget(self, dim: int) -> None:
        """Costs and room of a byte budget (``budget_unit`` ``fp_tokens`` or ``bytes``).

        The window's tokens cost their K/V in the model dtype plus a score each; the ring can hold
        ``W + interval`` of them before the next policy run, so that much is reserved and the tiers
        get the rest: the bound then holds at every step without a run per step.
        """
        cfg = self.cfg
        self.memory_budget = cfg.budget is not None and cfg.budget_unit != "tokens"
        if not self.memory_budget:
            return
        token_bytes = 2 * dim * self.window.k.element_size()
        on = (True, cfg.uses_mid_tier(), True)
        # Bytes of one record per tier (None: the mid tier is off), what the allocator trades.
        self.cost = tuple(lay.nbytes if used else None for lay, used in zip(self.layouts, on, strict=True))
        self.window_cost = token_bytes + 4
        self.cap = cfg.budget * token_bytes if cfg.budget_unit == "fp_tokens" else cfg.budget
        reserve = self.window.capacity * self.window_cost
        self.room = int(cfg.slack * (self.cap - reserve))
        if self.room < self.cost[0]:
            raise ValueError(
                f"TriStateConfig.budget={cfg.budget} ({cfg.budget_unit} per KV head = {self.cap} bytes) leaves "
                f"{self.room} bytes outside the window, less than one {self.cost[0]}-byte record: the window "
                f"(window + interval = {self.window.capacity} tokens x {self.window_cost} bytes) takes "
                f"{reserve}; raise the budget or lower window/interval"
            )
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
                for lay, c in zip(self.layouts, self.cost, strict=True)
            )

    # ------------------------------------------------------ Cache protocol
    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Called once per forward before any layer runs: a forward that raised half-way must not
        # leave its pending layer behind for this one.
        set_pending(None)
        # Slots are read by logical position: a boolean mask in logical coordinates. An empty layer's prompt
        # is ordinary causal attention, so there it may be skipped as for DynamicCache (SDPA's causal path
        # instead of a materialised T x T mask, which cost a one-shot prefill 40% of its time).
        request_logical_mask(skippable=not self.length)
        return self.length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "TriStateCache cannot be cropped: evicted and quantized tokens cannot be restored "
            "(is_croppable is False). Use the 'full' preset or DynamicCache for assisted/speculative decoding."
        )

    def offload(self):
        raise NotImplementedError("TriStateCache does not support offloading=True")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.cache.attention_ready():
            raise RuntimeError(
                f"TriStateCache is used on a model whose attention implementation is "
                f"{self.cache.model_config._attn_implementation!r}, not 'hfkv', so compressed tokens would be "
                "ignored. Call hfkv.enable(model) (TriStateCache(model, cfg) does it) and do not switch the "
                "attention implementation afterwards."
            )
        if pending() is not None:
            raise RuntimeError(
                "hfkv: a cache layer's update() was not followed by the hfkv attention function: the model using "
                f"this cache does not run hfkv attention (the cache was built for {self.cache.model_shape.describe()}; "
                "TriStateCache(model, ...) switches the model it is given, and a cache serves that model only), or "
                "its attention does not call past_key_values.update with standard K/V."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._rot is not None:  # stored rotated; attend() rotates the query alike and its output back
            key_states, value_states = rotate(key_states, self._rot), rotate(value_states, self._rot)
        q = key_states.shape[2]
        self._chunk = (key_states, value_states, self.length)
        if self.length > 0:
            # Triton writes a decode step's token into the ring in its attention launch (push_deferred).
            slot = None
            if self.backend == "triton" and q == 1:
                slot = self.window.push_deferred(key_states, value_states, self.length)
            if slot is not None:
                self._exits = None
            else:
                exits = self.window.push(key_states, value_states, self.length)
                self._exits = exits if exits[2].numel() else None
        self.length += q
        if self.length > q and self._exits is None:
            self._maybe_run_policy()
        set_pending(self)
        return key_states, value_states

    # ------------------------------------------------------------ internals
    def _not_padding(self, pos: torch.Tensor) -> torch.Tensor:
        """``[B, H, m]``: which of the window tokens at ``pos [m]`` are real (left padding is never kept)."""
        m = pos.numel()
        return (pos.view(1, 1, m) >= self.pad_end.view(-1, 1, 1)).expand(self.window.shape[0], self.window.shape[1], m)

    def _refresh_padded(self, unpadded: bool = False) -> None:
        """``unpadded``: the caller knows no row is padded (a prompt without a mask; rows selected from an unpadded
        batch), which needs no read of ``pad_end``; else it is read on a CPU and assumed on a GPU."""
        self._padded = not unpadded and (self.device.type != "cpu" or bool(self.pad_end.any()))
        self._pad_max = None

    def _exits_padded(self, first: int | None) -> bool:
        """Whether some of a run's exits may be left padding, the oldest at logical position ``first`` (None: not
        known on the host, a chunk's). Past the longest row's padding (read once a prompt, when first asked: on a
        GPU one wait, where every run of a padded batch would wait to ask whether everything fits) none is, and a
        run takes the unpadded paths: the exits admitted as they are, the room decided on the host."""
        if not self._padded:
            return False
        if first is None:
            return True
        if self._pad_max is None:
            self._pad_max = int(self.pad_end.max()) if self.pad_end.numel() else 0
        return first < self._pad_max

    def _admit_exits(self, k, v, pos: torch.Tensor, score: torch.Tensor) -> None:
        """Every exit exact, where no row is padded (a policy run in which nothing competes for the budget): the
        tokens in (b, h, i) order as they are, without a state map and its per-tier ``nonzero`` and gathers
        (a fifth of such a run's time at 512 tokens)."""
        bsz, heads, m, dim = k.shape
        grid = self._exit_heads.get((bsz, heads, m))
        if grid is None:
            rows = torch.arange(bsz * heads, device=self.device).repeat_interleave(m)
            grid = self._exit_heads[(bsz, heads, m)] = (rows // heads, rows % heads)
        flat = (k.reshape(-1, dim), v.reshape(-1, dim), pos.repeat(bsz * heads), score.reshape(-1))
        self.tiers.append_tokens(ORIGINAL, *grid, *flat)

    def _admit(self, k, v, pos: torch.Tensor, score: torch.Tensor, new: torch.Tensor, check_finite: bool) -> None:
        """Write already-classified tokens straight into their tiers (``k, v [B, H, m, D]``, ``pos [m]``).

        Deciding before writing means a token bound for the quantized tier is quantized once, from
        full precision, and an evicted one is never written at all.
        """
        formats, ends = [], []
        for tier, (b, h, i) in _tier_members(new, self.tiers.num_tiers):
            kt, vt = k[b, h, i], v[b, h, i]
            if check_finite:  # the values' ends stay on the device; one read for every tier below
                f, e = self.layouts[tier].encodable_ends(kt, vt)
                formats, ends = formats + f, ends + ([e] if e is not None else [])
            self.tiers.append_tokens(tier, b, h, kt, vt, pos[i], score[b, h, i])
        if ends:  # a bad value raises here, its tier written (the prompt cannot be admitted either way)
            check_ends(formats, torch.cat(ends))

    def _refresh_tier_peak(self) -> None:
        counts = self.tiers.counts
        if self.memory_budget:  # bytes: each tier's count times its record's (a product and a sum, 2 launches)
            if self._cost_t is None or self._cost_t.device != counts.device:
                costs = [c if c is not None else 0 for c in self.cost]
                self._cost_t = torch.tensor(costs, dtype=counts.dtype, device=counts.device)
            held = (counts * self._cost_t).sum(-1)
        else:
            held = counts.sum(-1)  # [B, H] tokens
        held = held.sum(-1) if self.cfg.head_adaptive else held
        self._tier_peak = int(held.max()) if held.numel() else 0

    def _maybe_run_policy(self) -> None:
        self.steps_since_policy += 1
        if self._policy_due(self.steps_since_policy, self.window.count, self.length):
            self.run_policy()

    def _policy_due(self, steps: int, count: int, length: int) -> bool:
        """Whether a step that leaves ``steps`` steps since the last policy run, ``count`` tokens in the window and
        the sequence ``length`` long runs the policy (host numbers only: no step waits on the device to decide)."""
        cfg = self.cfg
        # The ring (W + interval slots) fills exactly `interval` steps after the last batched exit.
        if steps >= cfg.interval or count == self.window.capacity:
            return True
        if cfg.stagger and steps and (length - self._phase) % cfg.interval == 0:  # this layer's turn
            return True
        if cfg.budget is None:
            return False
        # Between policy runs only the window grows, by the same count in every head.
        heads = self.window.shape[1] if cfg.head_adaptive else 1
        if self.memory_budget:
            return self._tier_peak + heads * count * self.window_cost > heads * self.cap
        return self._tier_peak + heads * count > heads * cfg.budget

    def decode_steps_before_policy(self, limit: int = 4096) -> int:
        """How many of the next one-token steps run no policy run (at most ``limit``): the steps a CUDA graph of
        one of them can replay (hfkv.graphs)."""
        if not self.is_initialized or self.length == 0:
            return 0
        steps, count, length = self.steps_since_policy, self.window.count, self.length
        for n in range(limit):
            steps, count, length = steps + 1, count + 1, length + 1
            if count > self.window.capacity or self._policy_due(steps, count, length):
                return n
        return limit

    def replayed_step(self, checked: bool = True) -> None:
        """The host side of a one-token step whose launches a CUDA graph replayed: what update() and attend()
        change on the host for a step between policy runs (the window took the token, which the kernel wrote,
        and the device step advanced). ``checked=False``: the caller counted the policy-free steps already."""
        if checked and (
            self._step_next is None or self.window.pending is not None or self.decode_steps_before_policy(1) < 1
        ):
            raise RuntimeError(
                f"hfkv: layer {self.layer_idx} cannot take a replayed step here (one runs the policy, or no "
                "Triton decode step ran since the last change of the ring)"
            )
        pos, slot = self._step_next
        self.window.count += 1
        self.length += 1
        self.steps_since_policy += 1
        self._step_next = (pos + 1, (slot + 1) % self.window.capacity)
        self._prepare_run_ahead()  # as attend() does: the next step's run, where it is due, from what the graph left

    def launch_signature(self) -> tuple:
        """What this layer's decode launches depend on: the launch plan (compare it by identity) and the storage
        it was made for. A policy run that grows or shrinks no table and no pool leaves both as they were, so
        a CUDA graph captured before the run replays after it (hfkv.graphs)."""
        return self._plan, self._plan_sig

    def plan_kept(self) -> bool:
        """Whether the last step's decode launch plan (built and compiled for the storage as it is now) serves
        the next step: no policy run or chunk changed the storage after that step's attention (hfkv.graphs)."""
        return self._plan is not None and self._plan_sig is not None

    def _device_step(self, write) -> torch.Tensor:
        """The device ``[position, slot]`` of this step's ring write, set from the host only where it is not
        already there (run_plan's ``step``)."""
        if self._step_dev is None:
            self._step_dev = torch.zeros(2, dtype=torch.int64, device=self.device)
        if self._step_next != (write.pos, write.slot):
            self._set_device_step(write.pos, write.slot)
        self._step_next = (write.pos + 1, (write.slot + 1) % self.window.capacity)
        return self._step_dev

    def _set_device_step(self, pos: int, slot: int) -> None:
        # fill_ takes the numbers as launch arguments: no host-to-device copy, nothing waits
        self._step_dev[0:1].fill_(pos)
        self._step_dev[1:2].fill_(slot)
        self._step_next = (pos, slot)
        self.step_fills += 1

    def _mean_over(self, length: int | None = None) -> tuple[int, int] | None:
        """What a score sum is averaged over (``score_mode="mean"``): the queries since ``score_start`` (up to
        ``length``, the layer's by default)."""
        return None if self.cfg.score_mode == "sum" else (self.length if length is None else length, self.score_start)

    def _mean_scores(self, sums: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return score_means(sums, pos, self._mean_over())

    def _classify(
        self, scores, state, pos, window_count: int, rho, over: bool = False, length: int | None = None
    ) -> torch.Tensor:
        """New states of the run's candidates (``over``: some row is known not to fit as it is, so the Triton
        allocation need not read back whether everything fits; ``length``: the layer's by default)."""
        bsz, heads = scores.shape[:2]
        length = self.length if length is None else length
        sink = Sinks(pos, self.sink_end)  # held slots below the row's sink end (the kernels compare them as they read)
        cfg = self.cfg
        if self.memory_budget:
            room = self.room * (heads if cfg.head_adaptive else 1)
            cap = None if rho is None else self._exact_cap(rho, heads)
            if self.backend == "cpu":  # the same decisions, selected in C++ instead of sorted in torch
                from hfkv.kernels.cpu.allocate import allocate_cpu as allocate_fn
            elif self.backend == "triton":  # the same decisions in three launches around the sort
                from hfkv.kernels.allocate import allocate_triton

                allocate_fn = partial(allocate_triton, fast_path=not over)
            else:
                allocate_fn = allocate
            return allocate_fn(
                scores,
                state,
                sink,
                length,  # every row's (one timeline): a launch argument, not a filled tensor
                self.alpha_h,
                self.alpha_l,
                room,
                self.cost,
                self.fidelity,
                cfg.head_adaptive,
                cap,
                cfg.score_prior,
            )
        return classify(
            scores,
            state,
            sink,
            torch.full((bsz,), length, dtype=torch.int64, device=self.device),
            torch.full((bsz,), window_count, dtype=torch.int64, device=self.device),
            self.alpha_h,
            self.alpha_l,
            cfg.budget,
            cfg.window,
            cfg.slack,
            cfg.head_adaptive,
            rho,
        )

    def run_policy(self, exits: tuple[torch.Tensor, ...] | None = None) -> None:
        """Re-classify every non-window token (DESIGN §3) and move/evict what changed state.

        Tokens past the newest W leave the window now (or ``exits``, those a chunk pushed out) and are
        classified together with the tiers, as candidates for the original tier (padding: evicted),
        then written where they belong.
        """
        self.policy_runs += 1
        ahead, self._ahead = self._ahead, None
        if ahead is not None and exits is None:  # what a prepared run must have been prepared for
            ahead = ahead if ahead[0] == self._ahead_key(*self._ring_now()) else None
        self.steps_since_policy = 0
        if exits is not None:
            self._run_policy(exits)
            return
        # the exits as views of the ring, their slots emptied once the run has read them
        first = self.length - self.window.count  # the ring holds the newest positions: the oldest exit's
        try:
            exits = self.window.pop_oldest_views(max(0, self.window.count - self.cfg.window))
            if ahead is not None:  # its first part ran after the last step's attention
                self._finish_run_ahead(ahead, exits)
            else:
                self._run_policy(exits, first)
        finally:
            self.window.clear_popped()

    def _ring_now(self) -> tuple[int, int, int, int]:
        """The layer's length, the ring's start and count, and the steps since the last run, as they are now."""
        return self.length, self.window.start, self.window.count, self.steps_since_policy

    def _ahead_key(self, length: int, start: int, count: int, steps: int) -> tuple:
        """What a run prepared ahead was prepared for: the layer's length, ring and steps since the last run as the
        step that runs it finds them, and the storage's tensors (a changed pool or table is another storage)."""
        tiers = self.tiers
        return length, start, count, steps, id(tiers.pool.data), tuple(map(id, tiers.tables))

    def _prepare_run_ahead(self) -> None:
        """Queue the next step's policy run up to its one host read, after this step's attention: the candidates,
        their classification and the move plan on the device, the plan's numbers copied to the host behind them
        (:class:`hfkv.kernels.host_read.HostRead`). Nothing of the layer changes until that step's update(), so the
        run sees what it would see then, and its read finds numbers that have long arrived instead of draining the
        GPU's queue to wait for them (docs/kernels.md, "A policy run's read, a step ahead"). Only for a run known
        to take the planned moves with that one read: the next step's update() pushes its token into a free
        slot and runs the policy on the ring's oldest tokens (views, or a gather where they wrap around the ring's
        end), and no read is needed to know that something competes for the room (``_nothing_competes``)."""
        self._ahead = None
        if not self.cfg.run_ahead:
            return
        win = self.window
        length, _, count, steps = (x + 1 for x in self._ring_now())  # as the next step's update() leaves them
        if count > win.capacity or not self._policy_due(steps, count, length):
            return
        n, s0 = count - self.cfg.window, win.start
        if n <= 0 or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        epos, escore = win.peek_oldest(n)  # the next step's push fills a free slot: the oldest stay where they are
        padded = self._exits_padded(self.length - win.count)
        if self.memory_budget and not self._has_floor and not self._over_room(n, padded):
            return  # _nothing_competes would read whether everything fits
        from hfkv.kernels.host_read import HostRead
        from hfkv.kernels.moves import launch_plan_moves

        new, valid, sizes = self._decide(epos, escore, length, count - n, padded)  # the window after the pop
        launched = launch_plan_moves(new, valid, sizes, *self._plan_inputs())
        self._ahead = (self._ahead_key(length, s0, count, steps), new, valid, sizes, launched, HostRead(launched[0]))

    def _finish_run_ahead(self, ahead: tuple, exits: tuple[torch.Tensor, ...]) -> None:
        """The rest of a run :meth:`_prepare_run_ahead` queued: its numbers read, its moves made (``_run_policy``'s)."""
        from hfkv.kernels.moves import finish_plan_moves

        _, new, valid, sizes, launched, numbers = ahead
        plan = finish_plan_moves(new, valid, sizes, launched, numbers.tolist())
        self._tier_peak = self._apply_planned(new, valid, sizes, exits, plan)
        self.runs_ahead += 1

    def _run_policy(self, exits: tuple[torch.Tensor, ...], first: int | None = None) -> None:
        """A policy run on ``exits`` (the oldest at logical position ``first``, where the host knows it)."""
        ek, ev, epos, escore = exits
        bsz, heads, m = escore.shape
        padded = self._exits_padded(first)
        if self._nothing_competes(epos, padded):
            # allocate() would keep every held token where it is and admit every exit exact (its own fast
            # path): only the admission has work to do.
            if m and not padded:
                self._admit_exits(ek, ev, epos, escore)
            elif m:
                new_exits = torch.where(self._not_padding(epos), ORIGINAL, EVICTED).to(torch.int8)
                self._admit(ek, ev, epos, escore, new_exits, check_finite=False)
            self._refresh_tier_peak()
            return
        new, valid, sizes = self._decide(epos, escore, self.length, self.window.count, padded)
        if self.backend == "triton":  # the moves planned on the device: no nonzero, sort or count read back
            self._tier_peak = self._apply_planned(new, valid, sizes, (ek, ev, epos, escore))
            return
        *news, new_exits = torch.split(new, [*sizes, m], dim=-1)
        changes = self._tier_changes(new, valid, sizes)
        valids = torch.split(valid, [*sizes, m], dim=-1)[: len(sizes)]
        self._apply(news, valids, changes, (ek, ev, epos, escore, new_exits) if m else None)
        self._refresh_tier_peak()

    def _decide(
        self, epos: torch.Tensor, escore: torch.Tensor, length: int, window_count: int, padded: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """A run's candidates (every tier's slots, then the exits ``epos, escore``) classified: ``(new, valid,
        sizes)``, for a layer ``length`` long holding ``window_count`` tokens in the window (``padded``: some exit
        may be padding)."""
        pos, scores, valid, state, sizes = self.tiers.candidates(epos, escore, self.pad_end, self._mean_over(length))
        rho = self._rho_past_budget(length, window_count)
        over = self._over_room(epos.numel(), padded)
        new = self._classify(scores, state, pos, window_count, rho, over, length=length)
        return new, valid, sizes

    def _exact_cap(self, rho: torch.Tensor, heads: int) -> torch.Tensor:
        """ARKV's OQ ratio as a cap on exact tokens: the layer's share of the exact tokens that would fit in
        the room (``[B]`` with ``head_adaptive``, else ``[B, H]``)."""
        base = self.cache._rho  # the cache's ratios (rho is this layer's row of them), kept until they are invalidated
        key = (tuple(rho.shape), heads, self.room)
        if self._cap_memo is not None and self._cap_memo[0] is base and self._cap_memo[1] == key:
            return self._cap_memo[2]  # the same ratios: the same cap, without its launches every policy run
        room = self.room * (heads if self.cfg.head_adaptive else 1)
        cap = torch.floor(rho.to(self.device).float() * (room / self.cost[ORIGINAL])).long()
        cap = cap if self.cfg.head_adaptive else cap.view(-1, 1).expand(cap.shape[0], heads).contiguous()
        self._cap_memo = (base, key, cap)  # contiguous: the allocation takes it as it is, no copy a run
        return cap

    def _nothing_competes(self, exit_pos: torch.Tensor, padded: bool) -> bool:
        """Whether a policy run can only admit the exits exact: a byte budget that every held token and every
        exit (at full precision) fits, no eviction floor (``alpha_l <= 0``: a floor can evict whatever the
        room) and no cap on exact tokens (ARKV's OQ ratio; none while the sequence fits, :meth:`_rho_past_budget`).
        Then :func:`allocate` returns the current states and ``ORIGINAL`` for the exits (padding: evicted) without
        ranking anything, and reading every tier's metadata to ask it would be the run's whole cost: at short
        contexts most runs are these (``padded``: some exit may be padding)."""
        if not self.memory_budget or self._has_floor or self._over_room(exit_pos.numel(), padded):
            return False
        heads = self.tiers.counts.shape[1]
        per = heads if self.cfg.head_adaptive else 1
        counts = self.tiers.counts
        # [B, H] exits that would be held exact (all of them without padding)
        entering = self._not_padding(exit_pos).sum(-1) if padded else exit_pos.numel()
        held = sum(counts[..., t] * c for t, c in enumerate(self.cost) if c is not None)  # [B, H] bytes
        held = held + entering * self.cost[ORIGINAL]
        exact = counts[..., ORIGINAL] + entering  # sinks included: at least what allocate() counts
        if self.cfg.head_adaptive:
            held, exact = held.sum(-1), exact.sum(-1)
        fits = (held <= self.room * per).all()
        rho = self._rho_past_budget(self.length, self.window.count)
        if rho is not None:  # both conditions in one host read
            fits = fits & (exact <= self._exact_cap(rho, heads)).all()
        return bool(fits)

    def _rho_past_budget(self, length: int, window_count: int) -> torch.Tensor | None:
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
        return None if fits else self.cache.rho(self.layer_idx)

    def _over_room(self, exits: int, padded: bool) -> bool:
        """Whether the fullest row (its held bytes are ``_tier_peak``, known since the tiers last changed) cannot take
        its ``exits`` exact, under a byte budget without floors, where no exit is padding (``padded`` False): then it
        holds more than its room as it is, so neither this run's host check nor the allocation's "does everything
        fit?" can say yes. Decided on the host, no tensor operation or wait (a long context's every run)."""
        if not self.memory_budget or self._has_floor or padded:
            return False
        per = self.tiers.counts.shape[1] if self.cfg.head_adaptive else 1
        return self._tier_peak + per * exits * self.cost[ORIGINAL] > per * self.room

    def _tier_changes(self, new: torch.Tensor, valid: torch.Tensor, sizes: list[int]) -> list[tuple[int, int]]:
        """Per tier: tokens demoted into a tier they stay in, and tokens leaving (one launch and one wait on the
        Triton backend, one C++ pass on the CPU one)."""
        if self.backend == "triton":
            from hfkv.kernels.changes import tier_changes

            return tier_changes(new, valid, sizes)
        if self.backend == "cpu":
            from hfkv.kernels.cpu.meta import tier_changes_cpu

            return tier_changes_cpu(new, valid, sizes)
        from hfkv.kernels.changes import tier_changes_reference

        return tier_changes_reference(new, valid, sizes)

    def _apply(
        self,
        news: list[torch.Tensor],
        valids: list[torch.Tensor],
        changes: list[tuple[int, int]],
        exits: tuple | None = None,
    ) -> None:
        """Move tokens whose state changed: drop the evicted, re-encode the demoted into their new tier, and
        write the classified window exits (``(k, v, pos, score, new)``, as :meth:`_admit` takes them).

        Demoted tokens and exits are appended together, one call per destination tier, in the order the
        tier-by-tier appends had (per head: demoted from each tier in tier order, then exits), so the
        storage is the same; each call costs a policy run a fixed few dozen tensor operations, which on
        a GPU are its launches (eval/policy_profile.py).
        """
        tiers = self.tiers
        moving = []  # (dest [n], b, h, k, v, pos, score)
        for tier, (new, valid) in enumerate(zip(news, valids, strict=True)):
            if not changes[tier][0]:
                continue
            b, h, s = (valid & (new > tier) & (new != EVICTED)).nonzero(as_tuple=True)
            moving.append((new[b, h, s], b, h, *tiers.gather_decoded(tier, b, h, s)))
        # Free the old slots before the demoted copies take new ones: the pool's peak (its capacity,
        # which is held) never has to hold a token twice.
        for tier, new in enumerate(news):
            if changes[tier][1]:
                tiers.remove(tier, new == tier)
        if exits is not None:
            ek, ev, epos, escore, new_exits = exits
            b, h, i = (new_exits != EVICTED).nonzero(as_tuple=True)
            if i.numel():
                moving.append(
                    (new_exits[b, h, i], b, h, ek[b, h, i].float(), ev[b, h, i].float(), epos[i], escore[b, h, i])
                )
        if not moving:
            return
        # (one source: no copy; each operation here is a launch on a GPU, where a policy run is bound by them)
        dest, b, h, k, v, pos, score = (torch.cat(x) if len(x) > 1 else x[0] for x in zip(*moving, strict=True))
        # Grouped by destination, then head; a stable sort keeps each head's tokens in their order above.
        order = torch.sort(dest.long() * (self.window.shape[0] * self.window.shape[1]) + b * self.window.shape[1] + h,
                           stable=True).indices  # fmt: skip
        # the one host read here (a bincount would read the largest destination first: two waits on a GPU)
        counts = torch.zeros(tiers.num_tiers, dtype=torch.int64, device=dest.device)
        counts = counts.index_add_(0, dest.long(), torch.ones_like(dest, dtype=torch.int64)).tolist()
        fields = [x[order] for x in (b, h, k, v, pos, score)]  # one gather each, sliced per tier
        self._append_by_tier(counts[: tiers.num_tiers], fields)

    def _append_by_tier(
        self, counts: list[int], fields: list[torch.Tensor], pages: list | None = None, heads: tuple | None = None
    ) -> None:
        """Append ``fields`` (``b, h, k, v, pos, score``, grouped by destination tier, ``counts[t]`` tokens for tier
        ``t``) one call per tier (``pages[t]``: its known new pages and widest head, ``heads``: each head's count and
        tokens entering per tier, a planned run's)."""
        start = 0
        for tier, n in enumerate(counts):
            if n:
                end = start + n
                known = {} if pages is None else {"pages": pages[tier]}
                if heads is not None:
                    known["heads"] = (heads[0][tier], heads[1][tier])
                self.tiers.append_tokens(tier, *(x[start:end] for x in fields), **known)
            start += n

    def _plan_inputs(self) -> tuple:
        """What ``plan_moves`` takes beside the candidates' states: the tiers' counts and records per page, and each
        tier's cost and the heads that share a room (for the tier peak after the run)."""
        tiers = self.tiers
        cost = [c or 0 for c in self.cost] if self.memory_budget else [1] * tiers.num_tiers
        return tiers.counts, tiers.tpp, (cost, tiers.counts.shape[1] if self.cfg.head_adaptive else 1)

    def _apply_planned(
        self, new: torch.Tensor, valid: torch.Tensor, sizes: list[int], exits: tuple, plan: tuple | None = None
    ) -> int:
        """:meth:`_apply` from a move plan made on the device (``hfkv.kernels.moves.plan_moves``, from the run's
        candidates ``new, valid``): the movers read and decoded into one buffer (a launch per source), the sources
        compacted, then one append per destination of its slice of the buffer. The storage it leaves is
        :meth:`_apply`'s, byte for byte, and the pages each removal frees and each append takes come with the plan's
        one read instead of one read each, as does the tier peak after the run (returned: what
        :meth:`_refresh_tier_peak` would read). ``plan``: that plan, made already (a run prepared ahead)."""
        from hfkv.kernels.moves import gather_exits, plan_moves

        tiers = self.tiers
        if plan is None:
            plan = plan_moves(new, valid, sizes, *self._plan_inputs())
        changes, entering, pages, peak, b, h, src, idx, heads = plan
        total = b.numel()
        if total:
            dim = exits[0].shape[-1]
            out = (torch.empty(total, dim, dtype=torch.float32, device=b.device),
                   torch.empty(total, dim, dtype=torch.float32, device=b.device),
                   torch.empty(total, dtype=torch.int64, device=b.device),
                   torch.empty(total, dtype=torch.float32, device=b.device))  # fmt: skip
            for tier, (demoted, _) in enumerate(changes):
                if demoted:
                    tiers.gather_decoded_into(tier, b, h, idx, src, out)
            if total > sum(d for d, _ in changes):
                gather_exits(*exits, b, h, src, idx, out)
        # the old slots freed before the movers take new ones (as _apply); the table set to its width after the
        # appends (pages[t][3], never below the removal's) once, not narrowed here and widened again there
        leave = [tier for tier, (_, leaving) in enumerate(changes) if leaving]
        tiers.remove_states(new, sizes, leave, [(pages[t][0], pages[t][3]) for t in leave])
        if total:
            self._append_by_tier(entering, [b, h, *out], [p[2:] for p in pages], heads)
        return peak

    # ------------------------------------------------------------ attention
    def attend(self, module, query, key, value, mask, scaling: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """Called by the hfkv attention function right after this layer's update(). ``out``: the tensor to write
        the result to (hfkv.graphs: where a replayed graph reads it), one this layer's attention returned for
        the same query shape; a Triton decode step writes it in place, any other path copies."""
        if self._rot is not None:  # (Hq).(Hk) = q.k: the keys and values were stored rotated (update())
            query = rotate(query, self._rot)
        if self.length == self._chunk[0].shape[2]:
            res = self._prefill(module, query, mask, scaling)
        else:
            res = self._attend_slots(query, mask, scaling, out)
        if self._rot is not None:  # sum p (Hv) = H (sum p v): rotated back (H is its own inverse)
            res = rotate(res, self._rot)
        if out is None or res is out:
            return res
        return out.copy_(res)

    def _prefill(self, module, query, mask, scaling) -> torch.Tensor:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        k, v, _ = self._chunk
        self._chunk = None
        if k.device.type == "cpu":
            # The projections leave [B, H, T, D] keys and values as a transposed view; torch's CPU flash attention
            # reads them 7-9% faster in bf16 when contiguous (DynamicCache's concatenation leaves them so), which
            # repays the copy 8 times over at 8k (SmolLM2's shape, 1 and 2 threads; no difference in fp32).
            k, v = k.contiguous(), v.contiguous()
        out = sdpa_attention_forward(module, query, k, v, mask, scaling=scaling)[0]
        self._admit_prompt(k, v, query, mask, scaling)
        return out

    def ingest_prefill(self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, scaling: float) -> None:
        """Fill an empty layer from a prompt's keys/values ``[B, H, T, D]`` (after RoPE) and its last queries
        ``[B, Hq, w', D]`` (``w' >= obs_window`` of the prompt's final positions; plain causal, no padding),
        leaving it exactly as a prefill forward through this cache would.

        Why: the prompt's attention output does not depend on the cache (prefill is dense), so an evaluation
        that compares many caches on one long prompt runs the model over it once and fills each cache from
        the captured tensors (``hfkv.evaluation.shared_prefill``).
        """
        if self.is_initialized and self.length:
            raise ValueError(f"ingest_prefill: layer {self.layer_idx} already holds {self.length} tokens")
        if query.shape[2] < min(self.cfg.obs_window, key.shape[2]):
            raise ValueError(
                f"ingest_prefill: {query.shape[2]} queries given, the observation window needs "
                f"min(obs_window={self.cfg.obs_window}, T={key.shape[2]})"
            )
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        if self._rot is not None:  # as update() and attend() rotate a prompt's
            key, value, query = (rotate(x, self._rot) for x in (key, value, query))
        self.length = key.shape[2]
        self._admit_prompt(key, value, query, None, scaling)

    def _admit_prompt(self, k, v, query, mask, scaling) -> None:
        """Scores, OQ statistics and tiers of a prompt that filled an empty layer (``query``: its last rows)."""
        bsz, heads, t, _ = k.shape
        pos = torch.arange(t, device=self.device)
        cfg = self.cfg
        w = min(cfg.obs_window, t)
        probs = mass = None
        if self.backend != "torch" and mask is None and cfg.gamma == 0:  # without the [B, Hq, w, T] probabilities
            if self.backend == "triton":
                from hfkv.kernels.observation import observation_scores
            else:  # the CPU's: the same logits, then one C++ pass (a dozen tensor operations a layer on torch's path)
                from hfkv.kernels.cpu.observation import observation_scores_cpu as observation_scores

            sums, mass = observation_scores(query, k, scaling, cfg.obs_window, cfg.score_reduction)
            sums = smooth_scores(sums, w, cfg.pool_kernel, cfg.carry)  # [B, H, T]
        else:
            probs = observation_probs(query, k, scaling, mask, cfg.obs_window)  # [B, Hq, w, T]
            sums = token_scores(probs, heads, cfg.score_reduction, cfg.gamma, cfg.pool_kernel, cfg.carry)
        key_valid = mask[:, 0, -1, :t].to(torch.bool) if mask is not None else torch.ones(bsz, t, dtype=torch.bool)
        key_valid = key_valid.to(self.device)
        self.pad_end = (~key_valid).long().cumprod(-1).sum(-1)  # leading padding per row
        self._refresh_padded(unpadded=mask is None)
        self.sink_end = self.pad_end + cfg.sink_tokens
        self.score_start = t - w
        nw = min(cfg.window, t)
        rest = t - nw
        if cfg.oq_ratios:
            considered = key_valid & (torch.arange(t, device=self.device) < rest)
            if mass is None:
                self.oq = oq_score(probs, considered, cfg.tau)
            elif self.backend == "triton":
                from hfkv.kernels.observation import oq_score_triton

                self.oq = oq_score_triton(mass, considered, cfg.tau)
            else:
                self.oq = oq_score_from_mass(mass, considered, cfg.tau)
            self.cache.invalidate_rho()
        self.window.push(k[:, :, rest:], v[:, :, rest:], pos[rest:])
        self.window.score[:, :, :nw] = sums[..., rest:]
        if rest > 0:
            p = pos[:rest].view(1, 1, rest).expand(bsz, heads, rest)
            valid = key_valid[:, None, :rest].expand(bsz, heads, rest)
            state = torch.where(valid, ORIGINAL, EVICTED).to(torch.int8)
            sc = sums[..., :rest]
            new = self._classify(self._mean_scores(sc, p), state, p, nw, None)
            self._admit(k[:, :, :rest], v[:, :, :rest], pos[:rest], sc, new, check_finite=True)
        self._refresh_tier_peak()

    def _attend_slots(self, query, mask, scaling, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.backend != "torch":  # Triton, or the CPU kernel (decode steps and prefill chunks alike)
            return self._attend_slots_kernel(query, scaling, out)
        self._chunk = None
        win = self.window
        bsz, heads = win.k.shape[:2]
        parts, tags, sizes = [(win.k, win.v)], [(win.pos + 1).to(torch.int32).expand(bsz, heads, -1)], [win.capacity]
        exits, self._exits = self._exits, None
        if exits is not None:
            parts.append((exits[0], exits[1]))
            tags.append((exits[2] + 1).to(torch.int32).expand(bsz, heads, -1))
            sizes.append(exits[2].numel())
        for tier, lay in enumerate(self.layouts):
            rec, tag = self.tiers.read_slots(tier)  # whole pages; empty slots have tag 0 and decode finite
            if rec.shape[2]:  # an empty tier (evict below budget, nothing quantized yet) costs nothing
                parts.append(lay.decode_kv_for_attention(rec))
                tags.append(tag)
            sizes.append(rec.shape[2])
        # A slot's tag (position + 1, 0 = empty) is its column in the logical mask: no index to build.
        slot_index = torch.cat(tags, -1)
        q = query.shape[2]
        # mask None: plain causal in logical coordinates, compared from the slots' positions
        out, received = slot_attention_received(
            query, parts, slot_index, mask, scaling, self.cfg.score_reduction, q_start=self.length - q
        )
        w_delta, *rest = torch.split(received, sizes, dim=-1)
        win.add_scores(w_delta)
        if exits is not None:
            exit_delta, *rest = rest
            exits = (*exits[:3], exits[3] + exit_delta)
        for tier, d in enumerate(rest):
            if d.shape[-1]:  # straight into the pages' score regions: masked slots received exact zeros
                self.tiers.add_scores(tier, d)
        if exits is not None:
            self.run_policy(exits)
        return out

    def _attend_slots_kernel(self, query, scaling, out: torch.Tensor | None = None) -> torch.Tensor:
        """The same attention through the paged kernels (Triton, or the CPU kernel): records are read and
        dequantized where they lie, scores are added in place, and the mask comes from slot positions
        (causal + left padding)."""
        kernels = _kernel_module(self.backend)
        self._chunk = None
        win, tiers = self.window, self.tiers
        write = win.pending if self.backend == "triton" else None
        if write is None:
            win.flush()
        exits, self._exits = self._exits, None
        q = query.shape[2]
        # Between policy runs a step's storage is the tensors of the last one: a signature of them (ids
        # and shapes, what plan_key holds) finds the kept plan without building the parts and their key.
        sig = None
        if exits is None:
            sig = (query.shape, query.dtype, query.device, write is not None, *map(id, win.raw()),
                   id(tiers.pool.data), tiers.pool.data.shape, *((id(t), t.shape) for t in tiers.tables))  # fmt: skip
        if sig is not None and self._plan is not None and self._plan_sig == sig:
            parts = self._plan_parts
        else:
            parts = [DenseSlots(*win.raw())]
            if exits is not None:
                exits = (*exits[:3], exits[3].contiguous().float())
                parts.append(DenseSlots(*exits))
            parts += [
                PagedSlots(tiers.pool.data, tiers.tables[t], tiers.tpp[t], lay) for t, lay in enumerate(self.layouts)
            ]
            if self.backend == "triton" and q > 1:
                tile = _chunk_tile(query, parts)
                if tile < q:
                    return self._attend_tiles(kernels, query, parts, tile, scaling, exits)
            # The launch plan depends only on the storage's tensors: it is rebuilt when a policy run, a
            # grown table or pool, or a new query shape changes them, not every step.
            key = plan_key(query, parts, write is not None)
            plan_type = kernels.DecodePlan if self.backend == "triton" else kernels.CpuPlan
            if self._plan is None or self._plan.key != key or not isinstance(self._plan, plan_type):
                if self.backend == "triton":
                    self._plan = kernels.plan_attention(
                        query, parts, self.pad_end, self.cfg.score_reduction, return_delta=False,
                        window_write=write is not None,
                    )  # fmt: skip
                else:  # the CPU kernel's parts described once per storage change, as the Triton plan
                    self._plan = kernels.plan_cpu(query, parts)
            self._plan_sig, self._plan_parts = sig, parts
        if self.backend == "triton":
            step = self._device_step(write) if write is not None else None
            out, _ = kernels.run_plan(
                self._plan, query, self.length - q, self.pad_end, scaling, write, checked=False, step=step, out=out
            )
        else:
            out, _ = kernels.paged_attention_cpu(
                query, parts, self.length - q, self.pad_end, scaling, self.cfg.score_reduction, return_delta=False,
                plan=self._plan, checked=False,
            )  # fmt: skip
        if write is not None:
            win.pending = None  # the kernel wrote it
            self._prepare_run_ahead()
        if exits is not None:
            self.run_policy(exits)
        return out

    def _attend_tiles(self, kernels, query, parts, tile: int, scaling, exits) -> torch.Tensor:
        """A chunk's attention in query tiles of ``tile`` queries (``CHUNK_LOGITS_BYTES``): each tile's softmax
        is whole (every slot is read for it), and the scores each tile adds to the slots sum to the chunk's."""
        q = query.shape[2]
        outs = []
        for t0 in range(0, q, tile):
            part_q = query[:, :, t0 : t0 + tile]
            out, _ = kernels.paged_attention(
                part_q, parts, self.length - q + t0, self.pad_end, scaling, self.cfg.score_reduction,
                return_delta=False,
            )  # fmt: skip
            outs.append(out)
        self._plan_sig = None  # as after an untiled chunk: the next step finds no kept plan by signature
        if exits is not None:
            self.run_policy(exits)
        return torch.cat(outs, dim=1)

    # ------------------------------------------------------- batch surgery
    def _select_rows(self, index: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        index = index.to(self.device)
        self._ahead = None
        self.window.select_rows(index)
        self.tiers.select_rows(index)
        self._refresh_tier_peak()
        for name in ("pad_end", "sink_end", "oq"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[index])
        self._refresh_padded(unpadded=not self._padded)
        self.cache.invalidate_rho()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.window.shape[0]).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices)

    def reset(self) -> None:
        if self.is_initialized:
            self.tiers.reset()
            bsz, heads, _, dim = self.window.shape
            self.window = WindowRing(bsz, heads, self.cfg.window, dim, self.dtype, self.device, self.cfg.interval)
        self._tier_peak, self._plan, self._plan_sig, self._plan_parts, self._ahead = 0, None, None, None, None
        self.length, self.steps_since_policy, self.score_start = 0, 0, 0
        self.pad_end = self.sink_end = self.oq = None
        self._padded, self._pad_max = True, None
        self.cache.invalidate_rho()

    # ------------------------------------------------------------- memory
    def held_tensors(self) -> list[torch.Tensor]:
        if not self.is_initialized:
            return []
        return [*self.window.held_tensors(), *self.tiers.held_tensors()]

    def token_states(self) -> torch.Tensor:
        """``[B, H, logical length]`` int8 state of every logical position (``hfkv.states``; WINDOW = -1).

        Built from what the layer holds (window positions, tier slot positions), so its counts are
        the counts of :meth:`layer_stats`: padding still in the window is WINDOW, like there.
        """
        if not self.is_initialized:
            return torch.zeros(0, 0, 0, dtype=torch.int8)
        bsz, heads = self.tiers.counts.shape[:2]
        out = torch.full((bsz, heads, self.length), EVICTED, dtype=torch.int8, device=self.device)
        for tier in range(self.tiers.num_tiers):
            pos, _, valid = self.tiers.read_meta(tier)
            b, h, s = valid.nonzero(as_tuple=True)
            out[b, h, pos[b, h, s].long()] = tier
        wpos = self.window.pos[self.window.pos >= 0]
        out[:, :, wpos] = WINDOW
        return out.cpu()

    def token_scores(self) -> torch.Tensor:
        """``[B, H, logical length]`` fp32 significance the policy sees for every held token (NaN: evicted).

        The policy's own measure: score sums divided by observation counts (``score_mode='mean'``).
        """
        if not self.is_initialized:
            return torch.zeros(0, 0, 0)
        bsz, heads = self.tiers.counts.shape[:2]
        out = torch.full((bsz, heads, self.length), float("nan"), device=self.device)
        for tier in range(self.tiers.num_tiers):
            pos, sums, valid = self.tiers.read_meta(tier)
            b, h, s = valid.nonzero(as_tuple=True)
            p = pos[b, h, s].long()
            out[b, h, p] = self._mean_scores(sums[b, h, s], p)
        live = self.window.pos >= 0
        wpos = self.window.pos[live]
        out[:, :, wpos] = self._mean_scores(self.window.score[:, :, live], wpos)
        return out.cpu()

    def layer_stats(self) -> LayerStats:
        if not self.is_initialized:
            return LayerStats(self.layer_idx, 0, 0, 0)
        bsz, heads, _, dim = self.window.k.shape
        counts = self.tiers.counts
        win = torch.full((bsz, heads), self.window.count, dtype=torch.int64)
        # Padding inside the window is not a kept token; it sits in the window until it leaves.
        evicted = self.length - win - counts.sum(-1).cpu()
        return LayerStats(
            layer=self.layer_idx,
            kv_bytes=held_bytes(self.held_tensors()),
            dense_bytes=dense_kv_bytes(bsz, heads, self.length, dim, self.dtype),
            logical_length=self.length,
            window=win.tolist(),
            original=counts[..., ORIGINAL].tolist(),
            mid=counts[..., MID].tolist(),
            quantized=counts[..., QUANTIZED].tolist(),
            evicted=evicted.tolist(),
            budget_bytes=self.cap * bsz * heads if self.memory_budget else None,
        )


def _calling_config(own: object) -> object | None:
    """The config of the attention module calling :meth:`TriStateCache.update` (transformers' attention layers call
    ``past_key_values.update(k, v, self.layer_idx, ...)``), or None where the caller is not one, or under
    torch.compile (which does not trace frames). Read on a layer's first call only: the calling model's layer count
    is known before its first layer stores anything."""
    if torch.compiler.is_compiling():
        return None
    caller = sys._getframe(2).f_locals.get("self")  # 0: here, 1: TriStateCache.update, 2: the attention's forward
    config = getattr(caller, "config", None)
    if config is None or config is own or not hasattr(config, "get_text_config"):
        return None
    return config


class TriStateCache(DynamicCache):
    """Drop-in ``past_key_values`` for ``model.generate``: ``TriStateCache(model, cfg)``.

    ``cfg`` is a ``TriStateConfig``, a preset name, or None for the ``hfkv`` preset. Building the
    cache calls ``hfkv.enable(model)``. Use a fresh cache per request (or ``reset()``).
    """

    def __init__(self, model: torch.nn.Module, config: TriStateConfig | str | None = None, **overrides) -> None:
        if config is None:
            config = TriStateConfig.from_preset("hfkv", **overrides)
        elif isinstance(config, str):
            config = TriStateConfig.from_preset(config, **overrides)
        elif overrides:
            import dataclasses

            config = dataclasses.replace(config, **overrides)
        if not isinstance(config, TriStateConfig):
            raise TypeError(
                f"TriStateCache: config must be a TriStateConfig or preset name, got {type(config).__name__}"
            )
        self.config = config
        enable(model)
        text = model.config.get_text_config(decoder=True)
        self.model_config = text
        self.model_shape = ModelShape.of(model)  # checked on each layer's first call (update)
        n_layers, n_kv, head_dim = self.model_shape.layers, self.model_shape.kv_heads, self.model_shape.head_dim
        config.validate_for_model(n_layers, n_kv, head_dim)
        self.alpha_h, self.alpha_l = config.resolve_alpha(n_layers, n_kv)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        layers: list = []
        for i, (lt, kw) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
            if not config.compress:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[lt](**kw))
            elif lt == "full_attention":
                layers.append(TriStateLayer(self, i))
            elif lt in _UNCOMPRESSED_TYPES:
                layers.append(DynamicSlidingWindowLayer(**kw))
            else:
                raise NotImplementedError(
                    f"hfkv cannot compress layer {i} of type {lt!r} ({type(model).__name__}); supported: "
                    f"'full_attention' (compressed) and {_UNCOMPRESSED_TYPES} (kept uncompressed)"
                )
        if config.compress and not any(isinstance(layer, TriStateLayer) for layer in layers):
            warnings.warn(
                f"TriStateCache: every layer of {self.model_shape.describe()} uses sliding-window attention, which "
                f"hfkv keeps uncompressed: preset {config.name!r} compresses nothing here (the cache is "
                "DynamicCache's)",
                UserWarning,
                stacklevel=2,
            )
        Cache.__init__(self, layers=layers)
        self._rho: torch.Tensor | None = None
        self._rho_rows: dict[int, torch.Tensor] = {}  # each layer's row of _rho on its device (rho)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # A layer's first call checks that the calling model is the one the cache was built for (after that, its
        # storage is made for these shapes and would fail on others anyway): one error naming both models.
        if layer_idx >= len(self.layers) or not self.layers[layer_idx].is_initialized:
            caller = _calling_config(self.model_config)
            self.model_shape.check_call(layer_idx, key_states, caller)
            if caller is not None and caller._attn_implementation != NAME:
                raise RuntimeError(
                    f"this TriStateCache was built for {self.model_shape.describe()} and is used by a model whose "
                    f"attention is {caller._attn_implementation!r}, not 'hfkv', so compressed tokens would be ignored: "
                    "a cache serves the model it was built with, TriStateCache(model, ...), which switches it"
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def __repr__(self) -> str:
        n = sum(isinstance(layer, TriStateLayer) for layer in self.layers)
        return (
            f"TriStateCache({self.config.summary()}, layers={len(self.layers)}, compressed={n}, "
            f"len={self.get_seq_length()}, backend={self.backend})"
        )

    @property
    def backend(self) -> str:
        """The backend compressed layers run on: ``config.backend`` resolved on the first layer's device
        (``auto`` until a layer has seen a tensor)."""
        for layer in self._tri_layers():
            if layer.is_initialized:
                return layer.backend
        return self.config.backend if self.config.compress else "torch"

    def _repr_html_(self) -> str:
        return cache_html(self.stats(), self.config.summary(), len(self.layers), self.oq_ratios())

    def attention_ready(self) -> bool:
        # Read from the instance dict: transformers' config attribute lookup costs ~5 us, and every
        # compressed layer checks this at every step (the property returns this same field).
        fields = object.__getattribute__(self.model_config, "__dict__")
        if "_attn_implementation_internal" in fields:
            return fields["_attn_implementation_internal"] == NAME
        return self.model_config._attn_implementation == NAME

    def _tri_layers(self) -> list[TriStateLayer]:
        return [layer for layer in self.layers if isinstance(layer, TriStateLayer)]

    def invalidate_rho(self) -> None:
        self._rho = None

    def rho(self, layer_idx: int) -> torch.Tensor | None:
        """OQ ratio of ``layer_idx`` per row, once every compressed layer has its prefill statistics."""
        if not self.config.oq_ratios:
            return None
        if self._rho is None:
            layers = self._tri_layers()
            if any(layer.oq is None for layer in layers):
                return None
            self._rho = oq_ratios(torch.stack([layer.oq.to(layers[0].device) for layer in layers]))
            self._rho_rows = {}
        row = self._rho_rows.get(layer_idx)
        if row is None:  # kept: every policy run of the layer asks (a search of the layers and a copy's check each)
            layers = self._tri_layers()
            pos = [layer.layer_idx for layer in layers].index(layer_idx)
            row = self._rho_rows[layer_idx] = self._rho[pos].to(layers[pos].device)
        return row

    def token_states(self, layer_idx: int) -> torch.Tensor:
        """``[B, KV heads, logical length]`` int8 map of token states of a compressed layer (``hfkv.states``:
        ORIGINAL 0, MID 1, QUANTIZED 2, EVICTED 3, WINDOW -1): which positions each head keeps, and how."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, TriStateLayer):
            raise ValueError(
                f"layer {layer_idx} is a {type(layer).__name__}, not a compressed TriStateLayer "
                f"(compressed layers: {[lyr.layer_idx for lyr in self._tri_layers()]})"
            )
        return layer.token_states()

    def token_scores(self, layer_idx: int) -> torch.Tensor:
        """``[B, KV heads, logical length]`` fp32 mean significance of every held token (NaN where evicted),
        the quantity compared with the thresholds ``alpha_h / N`` and ``alpha_l / N``."""
        self.token_states(layer_idx)  # same layer check
        return self.layers[layer_idx].token_scores()

    def thresholds(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(alpha_h / N, alpha_l / N)`` per KV head ``[H]`` of a layer at its current logical length N."""
        n = max(1, self.layers[layer_idx].get_seq_length())
        return self.alpha_h[layer_idx] / n, self.alpha_l[layer_idx] / n

    def oq_ratios(self) -> dict[int, torch.Tensor] | None:
        """ARKV's per-layer OQ ratios ``rho_l`` per batch row (``{layer: [B]}``), or None before they exist
        (OQ off, or the prefill of some layer has not run)."""
        if not self.config.oq_ratios:
            return None
        layers = self._tri_layers()
        if not layers or self.rho(layers[0].layer_idx) is None:
            return None
        return {layer.layer_idx: self.rho(layer.layer_idx).cpu() for layer in layers}

    def stats(self) -> CacheStats:
        per_layer = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, TriStateLayer):
                per_layer.append(layer.layer_stats())
            elif getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
                kb = held_bytes([layer.keys, layer.values])
                b, h, n, d = layer.keys.shape
                ls = LayerStats(i, kb, kb, layer.get_seq_length(), compressed=False)
                ls.window = [[n] * h for _ in range(b)]
                ls.original = ls.mid = ls.quantized = [[0] * h for _ in range(b)]
                # A sliding layer has dropped what left its window: those positions are evicted.
                ls.evicted = [[ls.logical_length - n] * h for _ in range(b)]
                if isinstance(layer, DynamicSlidingWindowLayer):
                    ls.dense_bytes = dense_kv_bytes(b, h, layer.get_seq_length(), d, layer.keys.dtype)
                per_layer.append(ls)
        return CacheStats(
            kv_bytes=sum(ls.kv_bytes for ls in per_layer),
            dense_bytes=sum(ls.dense_bytes for ls in per_layer),
            layers=per_layer,
            backend=self.backend,
            name=self.config.name,
            budget=self.config.budget if self.config.compress else None,
            budget_unit=self.config.budget_unit,
            head_adaptive=self.config.head_adaptive,
        )
