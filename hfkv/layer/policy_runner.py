"""When a layer's policy runs, and one run: candidates read, classified, and the moves handed to storage.

Why a part of its own: the policy (``hfkv.policy``) is a pure function of scores and states; running it on a live
layer is bookkeeping of its own: which steps run it (every ``interval`` steps, when the ring is full, at this
layer's staggered turn, or when the window would overflow the budget), decided from host numbers so no step waits
on the device; how many of the next steps are free of it (what a CUDA graph can replay, ``hfkv.graphs``); the run
itself (the ring's oldest tokens leave the window and are classified with every tier's tokens, then
``hfkv.storage.moves`` moves what changed state); its shortcut where nothing competes for the room; and a run
prepared a step ahead, after the previous step's attention, so that its one host read finds numbers that have
long arrived (docs/kernels.md, "A policy run's read, a step ahead"). The counters ``runs`` and ``runs_ahead`` are
what benchmarks report.
"""

from __future__ import annotations

import torch

from hfkv.kernels.host_read import HostRead
from hfkv.policy import classify as classify_states
from hfkv.policy import score_means
from hfkv.policy.unified import Sinks
from hfkv.states import EVICTED, ORIGINAL


class PolicyRunner:
    """The policy runs of one layer (``layer``: the TriStateLayer, whose window, tiers, budget and padding it reads)."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.cfg = layer.cfg
        self.steps = 0  # steps since the last run
        self.runs = 0  # every run() call: what a benchmark compares runs_ahead with
        self.runs_ahead = 0  # runs finished from a plan prepared a step ahead (finish_ahead)
        # stagger: the steps (lengths modulo interval) of this layer's runs, by its rank among the compressed
        # layers, so the runs spread evenly where only some layers are compressed
        self.phase = 0
        # The next step's run up to its host read, queued after this step's attention (prepare_ahead):
        # (key, new, valid, sizes, launched, numbers), or None.
        self.ahead: tuple | None = None
        self.alpha_h: torch.Tensor | None = None  # [H] this layer's thresholds on its device
        self.alpha_l: torch.Tensor | None = None

    def initialize(self, rank: int) -> None:
        """Set up at the layer's first tensors: its thresholds on its device and its ``rank`` among the compressed
        layers (the stagger phase)."""
        layer, cfg = self.layer, self.cfg
        self.alpha_h = layer.cache.alpha_h[layer.layer_idx].to(layer.device)
        self.alpha_l = layer.cache.alpha_l[layer.layer_idx].to(layer.device)
        self.phase = rank % cfg.interval if cfg.stagger else 0

    def reset(self) -> None:
        self.steps, self.ahead = 0, None

    # ------------------------------------------------------------ scheduling
    def step(self) -> None:
        """A step's token arrived without exits of its own: run the policy if it is due."""
        self.steps += 1
        layer = self.layer
        if self.due(self.steps, layer.window.count, layer.length):
            self.run()

    def due(self, steps: int, count: int, length: int) -> bool:
        """Whether a step that leaves ``steps`` steps since the last policy run, ``count`` tokens in the window and
        the sequence ``length`` long runs the policy (host numbers only: no step waits on the device to decide)."""
        cfg = self.cfg
        # The ring (W + interval slots) fills exactly `interval` steps after the last batched exit.
        if steps >= cfg.interval or count == self.layer.window.capacity:
            return True
        if cfg.stagger and steps and (length - self.phase) % cfg.interval == 0:  # this layer's turn
            return True
        return self.layer.budget.window_overflows(count)

    def steps_before(self, limit: int = 4096) -> int:
        """How many of the next one-token steps run no policy run (at most ``limit``)."""
        layer = self.layer
        if not layer.is_initialized or layer.length == 0 or layer.dense.active:  # a dense step is never replayed
            return 0
        steps, count, length = self.steps, layer.window.count, layer.length
        for n in range(limit):
            steps, count, length = steps + 1, count + 1, length + 1
            if count > layer.window.capacity or self.due(steps, count, length):
                return n
        return limit

    # ------------------------------------------------------------ a run
    def run(self, exits: tuple[torch.Tensor, ...] | None = None) -> None:
        """Re-classify every non-window token and move or evict what changed state (docs/architecture.md, "Life of a
        token").

        Tokens past the newest W leave the window now (or ``exits``, those a chunk pushed out) and are
        classified together with the tiers, as candidates for the original tier (padding: evicted),
        then written where they belong.
        """
        self.runs += 1
        ahead, self.ahead = self.ahead, None
        if ahead is not None and exits is None:  # what a prepared run must have been prepared for
            ahead = ahead if ahead[0] == self._ahead_key(*self._ring_now()) else None
        self.steps = 0
        if exits is not None:
            self.run_whole(exits)
            return
        win = self.layer.window
        # the exits as views of the ring, their slots emptied once the run has read them
        first = self.layer.length - win.count  # the ring holds the newest positions: the oldest exit's
        try:
            exits = win.pop_oldest_views(max(0, win.count - self.cfg.window))
            if ahead is not None:  # its first part ran after the last step's attention
                self.finish_ahead(ahead, exits)
            else:
                self.run_whole(exits, first)
        finally:
            win.clear_popped()

    def run_whole(self, exits: tuple[torch.Tensor, ...], first: int | None = None) -> None:
        """A run made whole at its step on ``exits`` (the oldest at logical position ``first``, where the host
        knows it)."""
        layer = self.layer
        budget, moves = layer.budget, layer.moves
        ek, ev, epos, escore = exits
        bsz, heads, m = escore.shape
        padded = layer.padding.exits_padded(first)
        if budget.nothing_competes(epos, padded):
            # allocate() would keep every held token where it is and admit every exit exact (its own fast
            # path): only the admission has work to do.
            if m and not padded:
                moves.admit_exits(ek, ev, epos, escore)
            elif m:
                new_exits = torch.where(layer.padding.not_padding(epos), ORIGINAL, EVICTED).to(torch.int8)
                moves.admit(ek, ev, epos, escore, new_exits, check_finite=False)
            budget.refresh_peak()
            return
        new, valid, sizes = self._decide(epos, escore, layer.length, layer.window.count, padded)
        if layer.ops.plans_moves:  # the moves planned on the device: no nonzero, sort or count read back
            budget.tier_peak = moves.apply_planned(new, valid, sizes, (ek, ev, epos, escore), budget.weights())
            return
        *news, new_exits = torch.split(new, [*sizes, m], dim=-1)
        changes = moves.tier_changes(new, valid, sizes)
        valids = torch.split(valid, [*sizes, m], dim=-1)[: len(sizes)]
        moves.apply(news, valids, changes, (ek, ev, epos, escore, new_exits) if m else None)
        budget.refresh_peak()

    def _decide(
        self, epos: torch.Tensor, escore: torch.Tensor, length: int, window_count: int, padded: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """A run's candidates (every tier's slots, then the exits ``epos, escore``) classified: ``(new, valid,
        sizes)``, for a layer ``length`` long holding ``window_count`` tokens in the window (``padded``: some exit
        may be padding)."""
        layer, budget = self.layer, self.layer.budget
        pos, scores, valid, state, sizes = layer.tiers.candidates(
            epos, escore, layer.padding.pad_end, self.mean_over(length)
        )
        if layer.retention.active:  # the fields hold the gates' values (mean_over is None: as stored)
            scores = layer.retention.scores(scores, pos, valid, length)
        rho = budget.rho_past_budget(length, window_count)
        over = budget.over_room(epos.numel(), padded)
        new = self.classify(scores, state, pos, window_count, rho, over, length=length)
        return new, valid, sizes

    def classify(
        self, scores, state, pos, window_count: int, rho, over: bool = False, length: int | None = None
    ) -> torch.Tensor:
        """New states of the run's candidates (``over``: some row is known not to fit as it is, so the Triton
        allocation need not read back whether everything fits; ``length``: the layer's by default)."""
        layer, budget, cfg = self.layer, self.layer.budget, self.cfg
        bsz, heads = scores.shape[:2]
        length = layer.length if length is None else length
        # held slots below the row's sink end (the kernels compare them as they read)
        sink = Sinks(pos, layer.padding.sink_end)
        if budget.memory_budget:
            room = budget.room * (heads if cfg.head_adaptive else 1)
            cap = None if rho is None else budget.exact_cap(rho, heads)
            return layer.ops.allocate(
                scores,
                state,
                sink,
                length,  # every row's (one timeline): a launch argument, not a filled tensor
                self.alpha_h,
                self.alpha_l,
                room,
                budget.cost,
                budget.fidelity,
                cfg.head_adaptive,
                cap,
                cfg.score_prior,
                over=over,
            )
        return classify_states(
            scores,
            state,
            sink,
            torch.full((bsz,), length, dtype=torch.int64, device=layer.device),
            torch.full((bsz,), window_count, dtype=torch.int64, device=layer.device),
            self.alpha_h,
            self.alpha_l,
            cfg.budget,
            cfg.window,
            cfg.slack,
            cfg.head_adaptive,
            rho,
        )

    def mean_over(self, length: int | None = None) -> tuple[int, int] | None:
        """What a score sum is averaged over (``score_mode="mean"``): the queries since the layer's ``score_start``
        (up to ``length``, the layer's by default); None: nothing (``"sum"``, or the fields hold learned values)."""
        layer = self.layer
        if self.cfg.score_mode == "sum" or layer.retention.active:
            return None
        return (layer.length if length is None else length, layer.score_start)

    def mean_scores(self, sums: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return score_means(sums, pos, self.mean_over())

    def ranked(self, sums: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, length: int) -> torch.Tensor:
        """What the policy ranks tokens at ``pos`` by, in a sequence ``length`` long: their learned retention
        (``score_source="retention"``) or the means of their score ``sums``."""
        if self.layer.retention.active:
            return self.layer.retention.scores(sums, pos, valid, length)
        return self.mean_scores(sums, pos)

    # ------------------------------------------------------------ a run prepared a step ahead
    def _ring_now(self) -> tuple[int, int, int, int]:
        """The layer's length, the ring's start and count, and the steps since the last run, as they are now."""
        layer = self.layer
        return layer.length, layer.window.start, layer.window.count, self.steps

    def _ahead_key(self, length: int, start: int, count: int, steps: int) -> tuple:
        """What a run prepared ahead was prepared for: the layer's length, ring and steps since the last run as the
        step that runs it finds them, and the storage's tensors (a changed pool or table is another storage)."""
        tiers = self.layer.tiers
        return length, start, count, steps, id(tiers.pool.data), tuple(map(id, tiers.tables))

    def prepare_ahead(self) -> None:
        """Queue the next step's policy run up to its one host read, after this step's attention: the candidates,
        their classification and the move plan on the device, the plan's numbers copied to the host behind them
        (:class:`hfkv.kernels.host_read.HostRead`). Nothing of the layer changes until that step's update(), so the
        run sees what it would see then, and its read finds numbers that have long arrived instead of draining the
        GPU's queue to wait for them (docs/kernels.md, "A policy run's read, a step ahead"). Only for a run known
        to take the planned moves with that one read: the next step's update() pushes its token into a free
        slot and runs the policy on the ring's oldest tokens (views, or a gather where they wrap around the ring's
        end), and no read is needed to know that something competes for the room (``Budget.nothing_competes``)."""
        self.ahead = None
        if not self.cfg.run_ahead:
            return
        layer = self.layer
        win, budget = layer.window, layer.budget
        length, _, count, steps = (x + 1 for x in self._ring_now())  # as the next step's update() leaves them
        if count > win.capacity or not self.due(steps, count, length):
            return
        n, s0 = count - self.cfg.window, win.start
        if n <= 0 or (layer.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        epos, escore = win.peek_oldest(n)  # the next step's push fills a free slot: the oldest stay where they are
        padded = layer.padding.exits_padded(layer.length - win.count)
        if budget.memory_budget and not budget.has_floor and not budget.over_room(n, padded):
            return  # nothing_competes would read whether everything fits
        # hfkv.kernels.moves imports triton (an optional dependency): only a backend that plans its moves gets here
        from hfkv.kernels.moves import launch_plan_moves

        new, valid, sizes = self._decide(epos, escore, length, count - n, padded)  # the window after the pop
        launched = launch_plan_moves(new, valid, sizes, *layer.moves.plan_inputs(budget.weights()))
        self.ahead = (self._ahead_key(length, s0, count, steps), new, valid, sizes, launched, HostRead(launched[0]))

    def finish_ahead(self, ahead: tuple, exits: tuple[torch.Tensor, ...]) -> None:
        """The rest of a run :meth:`prepare_ahead` queued: its numbers read, its moves made (``run_whole``'s)."""
        # hfkv.kernels.moves imports triton (an optional dependency): only a run prepared ahead gets here
        from hfkv.kernels.moves import finish_plan_moves

        budget = self.layer.budget
        _, new, valid, sizes, launched, numbers = ahead
        plan = finish_plan_moves(new, valid, sizes, launched, numbers.tolist())
        budget.tier_peak = self.layer.moves.apply_planned(new, valid, sizes, exits, budget.weights(), plan)
        self.runs_ahead += 1
