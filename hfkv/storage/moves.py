"""Moves of classified tokens between one layer's tiers: admitting new tokens, demoting, evicting.

Why a module of its own: a policy run (hfkv.layer.policy_runner) decides *which* state each token ends in; how
tokens then get there touches only the tiers, their record layouts and the batch/head shape, and has invariants
of its own that belong to storage: a token bound for a lower tier is encoded once, from full precision; an evicted
one is never written; old slots are freed before the demoted copies take new ones (the pool never holds a token
twice); and the appends happen in an order that leaves the same bytes in the same slots whichever way the moves
were found (per tier on the host, or planned on the device by ``hfkv.kernels.moves``). The layer holds one
:class:`Moves` per layer over its :class:`hfkv.storage.PagedTiers`.
"""

from __future__ import annotations

import torch

from hfkv.quant.formats import check_ends
from hfkv.states import EVICTED, ORIGINAL
from hfkv.storage.paged import PagedTiers


def tier_members(new: torch.Tensor, tiers: int):
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


class Moves:
    """The moves of one layer's tiers (``tiers``), with the index grids its admissions reuse."""

    def __init__(self, tiers: PagedTiers) -> None:
        self.tiers = tiers
        self._exit_heads: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def admit_exits(self, k, v, pos: torch.Tensor, score: torch.Tensor) -> None:
        """Every exit exact, where no row is padded (a policy run in which nothing competes for the budget): the
        tokens in (b, h, i) order as they are, without a state map and its per-tier ``nonzero`` and gathers
        (a fifth of such a run's time at 512 tokens)."""
        bsz, heads, m, dim = k.shape
        grid = self._exit_heads.get((bsz, heads, m))
        if grid is None:
            rows = torch.arange(bsz * heads, device=self.tiers.device).repeat_interleave(m)
            grid = self._exit_heads[(bsz, heads, m)] = (rows // heads, rows % heads)
        flat = (k.reshape(-1, dim), v.reshape(-1, dim), pos.repeat(bsz * heads), score.reshape(-1))
        self.tiers.append_tokens(ORIGINAL, *grid, *flat)

    def admit(self, k, v, pos: torch.Tensor, score: torch.Tensor, new: torch.Tensor, check_finite: bool) -> None:
        """Write already-classified tokens straight into their tiers (``k, v [B, H, m, D]``, ``pos [m]``).

        Deciding before writing means a token bound for the quantized tier is quantized once, from
        full precision, and an evicted one is never written at all.
        """
        tiers = self.tiers
        formats, ends = [], []
        for tier, (b, h, i) in tier_members(new, tiers.num_tiers):
            kt, vt = k[b, h, i], v[b, h, i]
            if check_finite:  # the values' ends stay on the device; one read for every tier below
                f, e = tiers.layouts[tier].encodable_ends(kt, vt)
                formats, ends = formats + f, ends + ([e] if e is not None else [])
            tiers.append_tokens(tier, b, h, kt, vt, pos[i], score[b, h, i])
        if ends:  # a bad value raises here, its tier written (the prompt cannot be admitted either way)
            check_ends(formats, torch.cat(ends))

    def tier_changes(self, new: torch.Tensor, valid: torch.Tensor, sizes: list[int]) -> list[tuple[int, int]]:
        """Per tier of a run's candidates (``new, valid``; ``sizes`` per tier, then the exits): tokens demoted into
        it that stay there, and tokens leaving it (one launch and one wait on the Triton backend, one C++ pass on the
        CPU one). :meth:`apply` takes them."""
        return self.tiers.ops.tier_changes(new, valid, sizes)

    def apply(
        self,
        news: list[torch.Tensor],
        valids: list[torch.Tensor],
        changes: list[tuple[int, int]],
        exits: tuple | None = None,
    ) -> None:
        """Move tokens whose state changed: drop the evicted, re-encode the demoted into their new tier, and
        write the classified window exits (``(k, v, pos, score, new)``, as :meth:`admit` takes them).

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
        order = torch.sort(dest.long() * (tiers.batch * tiers.heads) + b * tiers.heads + h, stable=True).indices
        # the one host read here (a bincount would read the largest destination first: two waits on a GPU)
        counts = torch.zeros(tiers.num_tiers, dtype=torch.int64, device=dest.device)
        counts = counts.index_add_(0, dest.long(), torch.ones_like(dest, dtype=torch.int64)).tolist()
        fields = [x[order] for x in (b, h, k, v, pos, score)]  # one gather each, sliced per tier
        self.append_by_tier(counts[: tiers.num_tiers], fields)

    def append_by_tier(
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

    def plan_inputs(self, weights: tuple[list[int], int]) -> tuple:
        """What ``plan_moves`` takes beside the candidates' states: the tiers' counts and records per page, and
        ``weights`` (each tier's cost and the heads that share a room: for the tier peak after the run)."""
        return self.tiers.counts, self.tiers.tpp, weights

    def apply_planned(
        self,
        new: torch.Tensor,
        valid: torch.Tensor,
        sizes: list[int],
        exits: tuple,
        weights: tuple[list[int], int],
        plan: tuple | None = None,
    ) -> int:
        """:meth:`apply` from a move plan made on the device (``hfkv.kernels.moves.plan_moves``, from the run's
        candidates ``new, valid``): the movers read and decoded into one buffer (a launch per source), the sources
        compacted, then one append per destination of its slice of the buffer. The storage it leaves is
        :meth:`apply`'s, byte for byte, and the pages each removal frees and each append takes come with the plan's
        one read instead of one read each, as does the tier peak after the run (returned: the largest held count,
        each tier's count weighted by ``weights``). ``plan``: that plan, made already (a run prepared ahead)."""
        # hfkv.kernels.moves imports triton (an optional dependency): only a backend that plans its moves gets here
        from hfkv.kernels.moves import gather_exits, plan_moves

        tiers = self.tiers
        if plan is None:
            plan = plan_moves(new, valid, sizes, *self.plan_inputs(weights))
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
        # the old slots freed before the movers take new ones (as apply); the table set to its width after the
        # appends (pages[t][3], never below the removal's) once, not narrowed here and widened again there
        leave = [tier for tier, (_, leaving) in enumerate(changes) if leaving]
        tiers.remove_states(new, sizes, leave, [(pages[t][0], pages[t][3]) for t in leave])
        if total:
            self.append_by_tier(entering, [b, h, *out], [p[2:] for p in pages], heads)
        return peak
