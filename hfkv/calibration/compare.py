"""The selected config against the shipped presets at equal memory, on problems held out from calibration.

A preset's memory is set by its ``budget``; we search the largest budget whose memory ratio on the
held-out problems is at most the calibrated config's (doubling/halving from the preset's own
budget, then bisection), so "better" means better quality at equal or lower memory. Every
evaluated budget is kept: together they trace each preset's quality-vs-memory curve.

One memory level says little: a config tuned at 0.9 of DynamicCache may lose at 0.15, where users
compress. :func:`compare_levels` therefore also matches the selected config (its thresholds, the
budget changed) and every preset to each of several memory levels (``--holdout-levels``, default
0.15 and 0.30 of DynamicCache), one small table per level.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from hfkv.calibration.objectives import METRICS, Evaluation
from hfkv.calibration.search import least_valid_budget
from hfkv.config import PRESETS, TriStateConfig


def _row(label: str, kind: str, ev: Evaluation, budget: int | None = None) -> dict:
    return {"config": label, "kind": kind, "budget": budget, **ev.to_dict()}


DEFAULT_LEVELS = (0.15, 0.30)


def parse_levels(text: str) -> list[float]:
    """``"0.15,0.30"`` -> ``[0.15, 0.3]``: at least two distinct memory ratios in (0, 1], sorted; ``none``
    -> ``[]`` (no comparison by level). The ValueError names the option, the value and what is allowed."""
    allowed = (
        "allowed: two or more distinct fractions of DynamicCache's memory in (0, 1], comma-separated, e.g. "
        "0.15,0.30 (or 'none')"
    )
    if text.strip().lower() == "none":
        return []
    parts = [p.strip() for p in text.replace(" ", ",").split(",") if p.strip()]
    levels = []
    for part in parts:
        try:
            x = float(part)
        except ValueError:
            raise ValueError(f"--holdout-levels={text!r}: {part!r} is not a number; {allowed}") from None
        if not (math.isfinite(x) and 0 < x <= 1):
            raise ValueError(f"--holdout-levels={text!r}: {part} is not a memory ratio in (0, 1]; {allowed}")
        levels.append(x)
    if len(set(levels)) < 2:
        raise ValueError(f"--holdout-levels={text!r}: {len(set(levels))} distinct level(s); {allowed}")
    return sorted(set(levels))


def memoized(
    evaluate: Callable[[TriStateConfig], Evaluation], path: Path | None = None, context: dict | None = None
) -> Callable[[TriStateConfig], Evaluation]:
    """``evaluate`` that runs each config once (the name aside): the comparison at the selected memory and
    the one per level probe many of the same budgets, and each probe is a pass over the held-out problems.

    With ``path``, every evaluation is also appended to that JSONL file (a line each, flushed and synced)
    under ``context`` (what an evaluation depends on besides the config: the held-out problems, the model,
    the objective), and the lines of the same context found there are reused. A comparison is tens of
    evaluations of minutes each on a CPU, so an interrupted one resumes where it stopped; a line cut short
    by the interruption is skipped.
    """
    seen: dict[str, Evaluation] = {}
    ctx = json.dumps(context, sort_keys=True, default=str) if context is not None else ""
    newline_first = False
    if path is not None and path.is_file():
        text = path.read_text(encoding="utf-8")
        newline_first = bool(text) and not text.endswith("\n")
        for line in text.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and row.get("context") == ctx:
                seen[row["config"]] = Evaluation(row["quality"], row["kv_bytes"], row["dense_bytes"], row["n"])

    def run(cfg: TriStateConfig) -> Evaluation:
        nonlocal newline_first
        key = json.dumps({**cfg.key_dict(), "name": "", "provenance": {}}, sort_keys=True, default=str)
        if key not in seen:
            ev = seen[key] = evaluate(cfg)
            if path is not None:
                row = {"context": ctx, "config": key, "quality": ev.quality, "kv_bytes": ev.kv_bytes,
                       "dense_bytes": ev.dense_bytes, "n": ev.n}  # fmt: skip
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a", encoding="utf-8") as fh:
                    fh.write(("\n" if newline_first else "") + json.dumps(row, sort_keys=True) + "\n")
                    fh.flush()
                    os.fsync(fh.fileno())
                newline_first = False
        return seen[key]

    return run


def budgeted(spec: str | TriStateConfig) -> Callable[[int], TriStateConfig]:
    """``budget -> config``: a preset through :meth:`TriStateConfig.from_preset` (which knows, e.g., that a
    streaming budget is its window), a config with its budget replaced and everything else kept."""
    if isinstance(spec, str):
        return lambda b: TriStateConfig.from_preset(spec, budget=b)
    return lambda b: dataclasses.replace(spec, budget=b)


def match_budget(
    evaluate: Callable[[TriStateConfig], Evaluation],
    preset: str | TriStateConfig,
    target: float,
    start: int,
    steps: int = 6,
) -> tuple[list[dict], dict | None]:
    """Evaluated points of ``preset`` (a preset name or a config) at several budgets, and the largest
    budget with memory <= ``target`` (None if none was found in ``steps`` evaluations).

    A budget the config accepts may still be refused by the model (the window's records fill it:
    :meth:`TriStateConfig.validate_for_model` needs the head size), which only shows when it is
    evaluated; such budgets count as too small, so low memory levels bisect up to the least the model
    takes instead of failing."""
    make = budgeted(preset)
    label = preset if isinstance(preset, str) else preset.name
    least = least_valid_budget(make)
    seen: dict[int, dict | None] = {}  # None: refused by the model

    def probe(b: int) -> str:
        if b not in seen:
            try:
                seen[b] = _row(f"{label}@{b}", "matched", evaluate(make(b)), b)
            except ValueError as exc:
                if not str(exc).startswith("TriStateConfig.budget="):  # only "too small for this model"
                    raise
                seen[b] = None
        row = seen[b]
        return "refused" if row is None else ("below" if row["memory_ratio"] <= target else "above")

    below = above = None
    refused = least - 1  # the largest budget known to be too small
    b = max(start, least)
    while len(seen) < steps:
        state = probe(b)
        if state == "refused":
            refused = max(refused, b)
        elif state == "below":
            if below is not None and b > below and seen[b]["memory_ratio"] == seen[below]["memory_ratio"]:
                below = b  # saturated: larger budgets keep everything, the target is out of reach above
                break
            below = b if below is None else max(below, b)
        else:
            above = b if above is None else min(above, b)
        if above is None:  # everything so far fits (or was refused): double
            nb = 2 * max(b, refused + 1)
        elif below is None:  # everything so far is above the target: halve, or bisect above what was refused
            nb = (refused + above) // 2 if refused >= least else max(least, above // 2)
        else:
            nb = (below + above) // 2
        if nb in seen or nb <= refused or (above is not None and nb >= above) or (below is not None and nb <= below):
            break
        b = nb
    points = sorted((r for r in seen.values() if r is not None), key=lambda r: r["memory_ratio"])
    return points, (seen[below] if below is not None else None)


def compare(
    evaluate: Callable[[TriStateConfig], Evaluation],
    selected: TriStateConfig,
    metric: str,
    others: Sequence[str],
    start_budget: int,
    steps: int = 6,
) -> dict:
    """Full cache, the selected config, and each entry of ``others`` (a preset, matched by budget, or a
    YAML file, evaluated as is) on the same problems."""
    full = evaluate(TriStateConfig.from_preset("full"))
    sel = evaluate(selected)
    rows = [_row("full", "reference", full), _row(selected.name, "calibrated", sel)]
    curves: dict[str, list[dict]] = {}
    verdicts = {}
    better = (lambda a, b: a <= b) if METRICS[metric][1] == "minimize" else (lambda a, b: a >= b)
    for other in others:
        if other in PRESETS:
            default_cfg = TriStateConfig.from_preset(other)
            rows.append(_row(other, "preset default", evaluate(default_cfg), default_cfg.budget))
            # A token budget (or fp-token memory budget) as long as the longest sequence keeps everything: start
            # there rather than at a default far beyond these sequences; a byte budget starts at its default.
            tokens = getattr(default_cfg, "budget_unit", "tokens") != "bytes"
            start = min(default_cfg.budget or start_budget, start_budget) if tokens else default_cfg.budget
            points, chosen = match_budget(evaluate, other, sel.memory_ratio, start or start_budget, steps)
            curves[other] = points
            if chosen is None:
                verdicts[other] = (
                    f"cannot reach memory {sel.memory_ratio:.4f} (lowest: {points[0]['memory_ratio']:.4f})"
                )
            else:
                rows.append(chosen)
                wins = better(sel.quality[metric], chosen[metric])
                verdicts[other] = (
                    f"{'calibrated better or equal' if wins else 'preset better'} at memory "
                    f"{chosen['memory_ratio']:.4f} <= {sel.memory_ratio:.4f}: {metric} {sel.quality[metric]:.4g} vs "
                    f"{chosen[metric]:.4g}"
                )
        else:
            path = Path(other)
            if not path.is_file():
                raise ValueError(f"--compare {other!r}: neither a preset {PRESETS} nor a YAML file")
            cfg = TriStateConfig.from_yaml(path)
            rows.append(_row(cfg.name, "config", evaluate(cfg), cfg.budget))
    return {"metric": metric, "rows": rows, "curves": curves, "verdicts": verdicts}


def compare_levels(
    evaluate: Callable[[TriStateConfig], Evaluation],
    selected: TriStateConfig,
    metric: str,
    others: Sequence[str],
    levels: Sequence[float],
    longest: int,
    steps: int = 6,
) -> list[dict]:
    """At each memory level: the selected config and each of ``others`` (presets, or YAML configs with
    their budget changed) at the largest budget whose memory is <= the level, with the full cache.

    The search starts at ``level x longest`` (a budget in full-precision tokens of that size holds about
    that share of the longest sequence) and doubles, halves and bisects from there (``steps`` evaluations
    per method and level). A method that cannot get down to a level is listed as such, not dropped."""
    better = (lambda a, b: a <= b) if METRICS[metric][1] == "minimize" else (lambda a, b: a >= b)
    full = _row("full", "reference", evaluate(TriStateConfig.from_preset("full")))
    methods: list[tuple[str, str, str | TriStateConfig]] = [(selected.name, "calibrated", selected)]
    for other in others:
        if other in PRESETS:
            methods.append((other, "preset", other))
        else:
            cfg = TriStateConfig.from_yaml(other)
            methods.append((cfg.name, "config", cfg))
    out = []
    for level in levels:
        rows, missing = [full], {}
        for name, kind, spec in methods:
            try:
                least = least_valid_budget(budgeted(spec))
            except ValueError as exc:  # e.g. a config that takes no budget
                missing[name] = {"lowest_memory": None, "lowest_budget": None, "message": f"no budget to match: {exc}"}
                continue
            start = max(least, round(level * longest))
            points, chosen = match_budget(evaluate, spec, level, start, steps)
            if chosen is None:
                lowest = points[0] if points else {"memory_ratio": None, "budget": None}
                missing[name] = {
                    "lowest_memory": lowest["memory_ratio"],
                    "lowest_budget": lowest["budget"],
                    "message": f"no budget tried reaches memory {level:.4f}"
                    + (f" (lowest: {lowest['memory_ratio']:.4f} at budget {lowest['budget']})" if points else ""),
                }
            else:
                rows.append({**chosen, "config": name, "kind": kind})
        sel = next((r for r in rows if r["kind"] == "calibrated"), None)
        verdicts = {}
        for r in rows:
            if r["kind"] in ("preset", "config") and sel is not None:
                wins = better(sel[metric], r[metric])
                verdicts[r["config"]] = (
                    f"{'calibrated better or equal' if wins else r['kind'] + ' better'}: {metric} {sel[metric]:.4g} "
                    f"(memory {sel['memory_ratio']:.4f}) vs {r[metric]:.4g} (memory {r['memory_ratio']:.4f})"
                )
        out.append({"level": level, "rows": rows, "missing": missing, "verdicts": verdicts})
    return out


def _grid(head: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns under a rule: the shape of every table this module prints."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [fmt(head), "-" * (sum(widths) + 2 * (len(widths) - 1)), *map(fmt, rows)]


def level_tables(levels: Sequence[dict]) -> str:
    """One small table per memory level: method, budget, quality, memory."""
    blocks = []
    for lv in levels:
        metrics = [m for m in ("kl", "top1", "accuracy") if m in lv["rows"][0]]
        rows = [
            [
                r["config"],
                "-" if r.get("budget") is None else str(r["budget"]),
                *(f"{r[m]:.4f}" for m in metrics),
                f"{r['memory_ratio']:.4f}",
            ]
            for r in lv["rows"]
        ]
        lines = [
            f"memory level {lv['level']:.2f} of DynamicCache:",
            *_grid(["method", "budget", *metrics, "memory"], rows),
        ]
        lines += [f"{k}: {v['message']}" for k, v in lv["missing"].items()]
        lines += [f"{k}: {v}" for k, v in lv["verdicts"].items()]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def table(result: dict) -> str:
    metrics = [m for m in ("kl", "top1", "accuracy") if m in result["rows"][0]]
    rows = [
        [r["config"], r["kind"], *(f"{r[m]:.4f}" for m in metrics), f"{r['memory_ratio']:.4f}"] for r in result["rows"]
    ]
    lines = _grid(["config", "kind", *metrics, "memory"], rows)
    lines += [f"{k}: {v}" for k, v in result["verdicts"].items()]
    return "\n".join(lines)


def plot(result: dict, path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hfkv.calibration.report import save_figure

    metrics = [m for m in ("kl", "top1", "accuracy") if m in result["rows"][0]]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4.2), squeeze=False)
    for ax, m in zip(axes[0], metrics, strict=True):
        for i, (name, pts) in enumerate(result["curves"].items()):
            ax.plot(
                [p["memory_ratio"] for p in pts],
                [p[m] for p in pts],
                "o-",
                ms=4,
                c=f"C{i}",
                label=f"{name} (budget sweep)",
            )
        for r in result["rows"]:
            if r["kind"] == "calibrated":
                ax.scatter([r["memory_ratio"]], [r[m]], marker="*", s=200, c="C3", zorder=5, label=r["config"])
            elif r["kind"] == "reference":
                ax.scatter([r["memory_ratio"]], [r[m]], marker="s", c="k", label="full cache")
            elif r["kind"] == "config":
                ax.scatter([r["memory_ratio"]], [r[m]], marker="D", s=50, zorder=4, label=r["config"])
            elif r["kind"] == "preset default":
                ax.scatter([r["memory_ratio"]], [r[m]], marker="x", s=50, c="0.3")
        for j, lv in enumerate(result.get("levels", [])):
            ax.axvline(lv["level"], ls=":", c="0.5", lw=1)
            matched = [r for r in lv["rows"] if r["kind"] == "calibrated"]
            ax.scatter(
                [r["memory_ratio"] for r in matched],
                [r[m] for r in matched],
                marker="*",
                s=120,
                c="C3",
                edgecolors="k",
                zorder=5,
                label="calibrated at the memory levels" if j == 0 else None,
            )
        ax.set_xlabel("KV memory / DynamicCache")
        ax.set_ylabel({"kl": "mean KL to full cache (nats)", "top1": "top-1 agreement"}.get(m, m))
        if m == "kl":
            ax.set_yscale("symlog", linthresh=1e-3)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("held-out problems (x: preset defaults; dotted: memory levels)")
    path = save_figure(fig, path)
    plt.close(fig)
    return path
