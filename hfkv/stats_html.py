"""How cache statistics read: number formats, state colours and the HTML summaries of notebooks.

It sits below the cache with ``hfkv.stats``: it imports only ``hfkv.states`` and reads statistics
through their fields (``LayerStats``, ``CacheStats``), so ``TriStateCache._repr_html_`` renders
without importing the introspection module (``hfkv.inspect``, which sits above the cache).

Token counts are shown per KV head: the mean over batch rows and KV heads, so a layer's five
counts add up to its length (``LayerStats.per_head``).
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import Any

from hfkv.states import STATE_ORDER

# Every figure and summary uses the same colours for the states.
STATE_COLORS: dict[str, str] = {
    "window": "#4c72b0",  # blue: recent, dense, not yet classified
    "original": "#55a868",  # green: kept in the original tier
    "mid": "#ccb974",  # sand: kept, quantized in the precise format
    "quantized": "#dd8452",  # orange: kept, quantized
    "evicted": "#e6e6e6",  # light grey: gone
}


def fmt_bytes(n: float) -> str:
    """``1,074,072`` -> ``"1.02 MiB"`` (binary units, two decimals past KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_count(x: float) -> str:
    """A token count, or a mean of counts: ``2,427``, or ``19.5`` when it is not whole."""
    return f"{round(x):,}" if abs(x - round(x)) < 1e-9 else f"{x:,.1f}"


def plural(n: int, word: str) -> str:
    """``1 row``, ``2 rows``."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def fmt_share(p: float) -> str:
    """``0.54`` -> ``"54%"``; below 10% one decimal (``"0.8%"``), and exactly ``"0%"`` for nothing."""
    return f"{p:.0%}" if p == 0 or p >= 0.1 else f"{p:.1%}"


def state_shares(layers: Iterable[Any]) -> dict[str, float]:
    """Share of the cache's (layer, row, KV head, position) tokens in each state (window first)."""
    totals = {name: 0 for name in STATE_ORDER}
    for ls in layers:
        for name, n in ls.totals().items():
            totals[name] += n
    total = sum(totals.values())
    return {name: n / total if total else 0.0 for name, n in totals.items()}


def compression(dense_bytes: int, kv_bytes: int) -> float:
    return dense_bytes / kv_bytes if kv_bytes else float("inf")


# --------------------------------------------------------------------------------- HTML
def cache_html(stats: Any, config_summary: str, num_layers: int, oq: dict | None = None) -> str:
    """``TriStateCache._repr_html_``: config, memory, budget, and per layer compression, tokens per KV head
    in each state and the OQ ratio. ``stats`` is the cache's ``CacheStats``; ``num_layers`` counts every
    model layer (``stats.layers`` leaves out dense layers that hold nothing yet)."""
    layers = stats.layers
    n_comp = sum(ls.compressed for ls in layers)
    batch = len(layers[0].window) if layers else 0
    length = max((ls.logical_length for ls in layers), default=0)
    head = (
        f"<b>TriStateCache</b> <code>{html.escape(config_summary)}</code><br>"
        f"{num_layers} layers ({n_comp} compressed) &middot; batch {batch} &middot; {length:,} tokens"
    )
    body = stats_html(layers, stats.kv_bytes, stats.dense_bytes, oq, wrap=False, note=stats.budget_text())
    return _wrap(head + body)


def stats_html(
    layers: Iterable[Any],
    kv_bytes: int | None = None,
    dense_bytes: int | None = None,
    oq: dict | None = None,
    wrap: bool = True,
    note: str | None = None,
) -> str:
    """``CacheStats`` / ``LayerStats`` as HTML: totals, ``note`` (the budget line), then one table row per
    layer with its tokens per KV head in each state (mean over rows and heads) and a bar of the shares."""
    layers = list(layers)
    if kv_bytes is None:
        kv_bytes = sum(ls.kv_bytes for ls in layers)
    if dense_bytes is None:
        dense_bytes = sum(ls.dense_bytes for ls in layers)
    if not any(ls.logical_length for ls in layers):
        body = "<div>empty: nothing cached yet</div>"
        return _wrap(body) if wrap else body
    shares = state_shares(layers)
    legend = " ".join(f"{_swatch(name)}&nbsp;{name} {fmt_share(shares[name])}" for name in STATE_ORDER)
    rows_, heads = len(layers[0].window), len(layers[0].window[0]) if layers[0].window else 0
    summary = (
        f"<div>KV held <b>{fmt_bytes(kv_bytes)}</b> ({kv_bytes:,} B) &middot; DynamicCache would hold "
        f"{fmt_bytes(dense_bytes)} ({dense_bytes:,} B) &middot; compression "
        f"<b>{compression(dense_bytes, kv_bytes):.2f}x</b></div>"
        + (f"<div>{html.escape(note)}</div>" if note else "")
        + f"<div>tokens in each state: {legend}</div>"
    )
    cols = ["layer", "tokens", "KV bytes", "dense bytes", "compression", *STATE_ORDER]
    if oq:
        cols.append("OQ ratio")
    cols.append("states")
    rows = []
    for ls in layers:
        per_head = ls.per_head()
        cells = [
            f"{ls.layer}" + ("" if ls.compressed else " (dense)"),
            f"{ls.logical_length:,}",
            f"{ls.kv_bytes:,}",
            f"{ls.dense_bytes:,}",
            f"{ls.dense_bytes / ls.kv_bytes:.2f}x" if ls.kv_bytes else "&ndash;",
            *(fmt_count(per_head[name]) for name in STATE_ORDER),
        ]
        if oq:
            cells.append(", ".join(f"{float(r):.3f}" for r in oq[ls.layer]) if ls.layer in oq else "&ndash;")
        cells.append(_bar(ls.totals()))
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    caption = (
        f'<caption style="caption-side:bottom;text-align:left">{", ".join(STATE_ORDER)}: tokens per KV head '
        f"(mean over {plural(rows_, 'row')} x {plural(heads, 'KV head')}; they add up to the layer's tokens)</caption>"
    )
    table = (
        '<table style="border-collapse:collapse;font-size:90%">'
        + caption
        + "<thead><tr>"
        + "".join(f"<th>{c}</th>" for c in cols)
        + "</tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table>"
    )
    # Many layers (30+ on real models): keep the summary on screen, the table one click away.
    details = f"<details{' open' if len(layers) <= 12 else ''}><summary>per layer</summary>{table}</details>"
    body = summary + details
    return _wrap(body) if wrap else body


def _wrap(body: str) -> str:
    return f'<div class="hfkv-summary" style="font-family:sans-serif;font-size:13px">{body}</div>'


def _swatch(name: str) -> str:
    return f'<span style="display:inline-block;width:10px;height:10px;background:{STATE_COLORS[name]}"></span>'


def _bar(totals: dict[str, int], width: int = 120) -> str:
    total = sum(totals.values())
    if not total:
        return ""
    spans = "".join(
        f'<span title="{name} {n:,}" style="display:inline-block;height:10px;width:{width * n / total:.1f}px;'
        f'background:{STATE_COLORS[name]}"></span>'
        for name, n in totals.items()
        if n
    )
    return f'<span style="display:inline-flex;width:{width}px">{spans}</span>'


__all__ = ["STATE_COLORS", "cache_html", "fmt_bytes", "fmt_count", "fmt_share", "plural", "state_shares", "stats_html"]
