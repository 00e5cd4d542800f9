"""Memory and state counts of a cache, measured from the tensors it holds, and how they read.

Statistics sit below the cache: this module imports neither ``hfkv.cache`` nor ``hfkv.inspect``
(the cache builds these objects; introspection above the cache reads them). Token counts are kept per
(batch row, KV head); a person reads them per KV head (``LayerStats.per_head``: the mean over rows
and heads, whose states add up to the layer's length), a frame as one row per (layer, row, KV head,
state) (``CacheStats.to_dataframe``).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from hfkv.states import STATE_NAMES, STATE_ORDER
from hfkv.stats_html import compression, fmt_bytes, fmt_count, fmt_share, plural, state_shares, stats_html

# Where the budget's accounting is written down (what a budget counts, what it leaves out).
BUDGET_DOC = 'docs/generate.md, "What budget counts"'


@dataclass
class LayerStats:
    layer: int
    kv_bytes: int
    dense_bytes: int
    logical_length: int
    # per (batch row, KV head): tokens in each state; "window" is reported separately from "original"
    window: list[list[int]] = field(default_factory=list)
    original: list[list[int]] = field(default_factory=list)
    mid: list[list[int]] = field(default_factory=list)  # quantized in the precise format (memory budgets)
    quantized: list[list[int]] = field(default_factory=list)
    evicted: list[list[int]] = field(default_factory=list)
    compressed: bool = True
    # Bytes a memory budget allows this layer: its cap per KV head x rows x KV heads (None: a token budget,
    # no budget, or a dense layer). What it covers and what it leaves out: BUDGET_DOC.
    budget_bytes: int | None = None

    @property
    def rows(self) -> int:
        """Batch rows the counts cover."""
        return len(self.window)

    @property
    def kv_heads(self) -> int:
        return len(self.window[0]) if self.window else 0

    def totals(self) -> dict[str, int]:
        """Tokens per state summed over batch rows and KV heads (``window`` first, then ``STATE_NAMES``):
        ``rows x kv_heads`` times what one head holds on average."""
        return {name: sum(map(sum, getattr(self, name))) for name in STATE_ORDER}

    def per_head(self) -> dict[str, float]:
        """Tokens per KV head in each state: the mean over batch rows and KV heads. Each head's states
        add up to ``logical_length`` (an evicted token still counts as a position), so these do too."""
        n = self.rows * self.kv_heads
        return {name: total / n if n else 0.0 for name, total in self.totals().items()}

    def _repr_html_(self) -> str:
        return stats_html([self])


@dataclass
class CacheStats:
    """``kv_bytes`` is what the cache holds (storage capacity, metadata included); ``dense_bytes`` what
    DynamicCache would hold for the same logical length. ``compression_ratio = dense / kv``.

    ``print(stats)`` reads per layer with token counts per KV head; :meth:`summary` is one line;
    :meth:`to_dataframe` (tidy counts) and :meth:`layer_frame` (bytes per layer) are for pandas.
    """

    kv_bytes: int
    dense_bytes: int
    layers: list[LayerStats]
    # The path compressed layers ran on ("torch" or "triton"; "torch" too where nothing is compressed).
    backend: str = "torch"
    # The config's name and budget (``TriStateConfig.name / budget / budget_unit / head_adaptive``); None
    # where the statistics were not built by a cache. The budget is per KV head (per layer row when
    # head-adaptive): tokens (``budget_unit="tokens"``) or a memory cap (``fp_tokens``, ``bytes``).
    name: str | None = None
    budget: int | None = None
    budget_unit: str | None = None
    head_adaptive: bool = False

    @property
    def compression_ratio(self) -> float:
        return compression(self.dense_bytes, self.kv_bytes)

    @property
    def budget_bytes(self) -> int | None:
        """Bytes a memory budget allows the compressed layers together (None: no memory budget)."""
        caps = [ls.budget_bytes for ls in self.layers if ls.compressed]
        return sum(caps) if caps and None not in caps else None

    def budget_text(self) -> str | None:
        """The budget and how the cache stands against it, in words (None: the budget is not known)."""
        if self.name is None:
            return None
        if self.budget is None:
            return "budget: none"
        comp = [ls for ls in self.layers if ls.compressed and ls.rows]
        if not comp:
            return f"budget: {self.budget:,} {self.budget_unit} per KV head; nothing cached yet"
        rows, heads = comp[0].rows, comp[0].kv_heads
        scope = "per KV head" + (
            f" (head-adaptive: a row's {heads} KV heads share {heads}x it)" if self.head_adaptive else ""
        )
        counted = "window and every tier counted"
        cap = self.budget_bytes
        if cap is not None:
            per_head = cap // (len(comp) * rows * heads)
            unit = f"{self.budget:,} fp_tokens" if self.budget_unit == "fp_tokens" else f"{self.budget:,} B"
            held = sum(ls.kv_bytes for ls in comp)
            return (
                f"budget: {unit} {scope} = {per_head:,} B; x {plural(heads, 'KV head')} x {plural(rows, 'row')} "
                f"x {plural(len(comp), 'layer')} = {cap:,} B ({fmt_bytes(cap)}); held {held / cap:.1%} of it "
                f"(outside it: page tails, page tables, a zero page per layer; {BUDGET_DOC})"
            )
        kept = ("window", *STATE_NAMES[:-1])
        if self.head_adaptive:
            most = max(
                sum(getattr(ls, n)[b][h] for n in kept for h in range(heads)) for ls in comp for b in range(rows)
            )
            return (
                f"budget: {self.budget:,} tokens {scope}, {counted}; the fullest row holds "
                f"{fmt_count(most / heads)} per head"
            )
        most = max(sum(getattr(ls, n)[b][h] for n in kept) for ls in comp for b in range(rows) for h in range(heads))
        return f"budget: {self.budget:,} tokens {scope}, {counted}; the fullest head holds {most:,}"

    def summary(self) -> str:
        """One line: layers, tokens, bytes held vs DynamicCache, the budget used, each state's share of tokens.

        ``"hfkv: 4 layers x 2 KV heads, 2,427 tokens; 1.02 MiB held vs 2.37 MiB dense (2.31x, 102% of
        budget); tokens: 0.8% window, 54% mid, 45% quantized, 0% evicted"`` (states holding nothing are
        left out, except ``evicted``).
        """
        name = f"{self.name}: " if self.name else ""
        live = [ls for ls in self.layers if ls.rows]
        if not any(ls.logical_length for ls in live):
            return f"{name}empty (nothing cached yet)"
        length = max(ls.logical_length for ls in live)
        rows = live[0].rows
        shape = f"{plural(len(self.layers), 'layer')} x {plural(live[0].kv_heads, 'KV head')}"
        shape += f" x {rows} rows" if rows > 1 else ""
        extra = ""
        if self.budget_bytes:
            held = sum(ls.kv_bytes for ls in live if ls.compressed)
            extra = f", {held / self.budget_bytes:.0%} of budget"
            if held > self.budget_bytes:  # a user reading 114% must not think the budget was broken
                extra += " (it leaves out page tails and tables)"
        shares = state_shares(live)
        states = ", ".join(f"{fmt_share(p)} {n}" for n, p in shares.items() if p or n == "evicted")
        return (
            f"{name}{shape}, {length:,} tokens; {fmt_bytes(self.kv_bytes)} held vs {fmt_bytes(self.dense_bytes)} "
            f"dense ({self.compression_ratio:.2f}x{extra}); tokens: {states}"
        )

    def to_dataframe(self):
        """Tidy token counts: one row per (layer, batch row, KV head, state), columns ``layer, row, kv_head,
        state, tokens`` (``state`` categorical in ``hfkv.states.STATE_ORDER``). A head's five states add up to
        the layer's logical length. Bytes are per layer: :meth:`layer_frame`. Wide, one column per state:
        ``frame.pivot_table(index=["layer", "row", "kv_head"], columns="state", values="tokens", observed=True)``.
        """
        import pandas as pd  # optional: pandas (an extra)

        rows = [
            (ls.layer, b, h, name, getattr(ls, name)[b][h])
            for ls in self.layers
            for b in range(ls.rows)
            for h in range(len(ls.window[b]))
            for name in STATE_ORDER
        ]
        frame = pd.DataFrame(rows, columns=["layer", "row", "kv_head", "state", "tokens"])
        frame["state"] = pd.Categorical(frame["state"], categories=list(STATE_ORDER))
        return frame

    def layer_frame(self):
        """One row per layer: bytes, compression and tokens per state summed over rows and heads.

        The per-layer view a plot of "where the memory goes" needs (bytes are held per layer, so they are
        here and not in :meth:`to_dataframe`).
        """
        import pandas as pd  # optional: pandas (an extra)

        rows = [
            {
                "layer": ls.layer,
                "compressed": ls.compressed,
                "tokens": ls.logical_length,
                "kv_bytes": ls.kv_bytes,
                "dense_bytes": ls.dense_bytes,
                "compression": compression(ls.dense_bytes, ls.kv_bytes),
                **ls.totals(),
            }
            for ls in self.layers
        ]
        columns = ["layer", "compressed", "tokens", "kv_bytes", "dense_bytes", "compression", *STATE_ORDER]
        return pd.DataFrame(rows, columns=columns)

    def _repr_html_(self) -> str:
        return stats_html(self.layers, kv_bytes=self.kv_bytes, dense_bytes=self.dense_bytes, note=self.budget_text())

    def __str__(self) -> str:
        live = [ls for ls in self.layers if ls.rows]
        n_comp = sum(ls.compressed for ls in self.layers)
        shape = f"{plural(len(self.layers), 'layer')} ({n_comp} compressed)"
        if live:
            rows, heads = live[0].rows, live[0].kv_heads
            length = max(ls.logical_length for ls in live)
            shape += f", {plural(rows, 'batch row')} x {plural(heads, 'KV head')}, {length:,} tokens"
        lines = [
            f"CacheStats{f' ({self.name})' if self.name else ''}: {shape}, backend={self.backend}",
            f"  kv_bytes={self.kv_bytes:,} ({fmt_bytes(self.kv_bytes)}) held vs dense_bytes={self.dense_bytes:,} "
            f"({fmt_bytes(self.dense_bytes)}) in a DynamicCache: compression_ratio={self.compression_ratio:.2f}x",
        ]
        note = self.budget_text()
        if note:
            lines.append(textwrap.fill(note, 110, initial_indent="  ", subsequent_indent="    "))
        if not live:
            return "\n".join(lines)
        lines.append(
            f"  tokens per KV head in each state (mean over {plural(rows, 'row')} x {plural(heads, 'KV head')}; "
            f"they add up to len; every head: to_dataframe()):"
        )
        head = ["layer", "len", "KV bytes", "dense bytes", "ratio", *STATE_ORDER]
        table = [head]
        for ls in self.layers:
            per_head = ls.per_head()
            table.append(
                [
                    f"{ls.layer}" + ("" if ls.compressed else " dense"),
                    f"{ls.logical_length:,}",
                    f"{ls.kv_bytes:,}",
                    f"{ls.dense_bytes:,}",
                    f"{compression(ls.dense_bytes, ls.kv_bytes):.2f}x",
                    *(fmt_count(per_head[name]) for name in STATE_ORDER),
                ]
            )
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in table]
        return "\n".join(lines)
