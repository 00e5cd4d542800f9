"""The selected config against the shipped presets at equal memory, on problems held out from calibration.

A preset's memory is set by its ``budget``; we search the largest budget whose memory ratio on the
held-out problems is at most the calibrated config's (doubling/halving from the preset's own
budget, then bisection), so "better" means better quality at equal or lower memory. Every
evaluated budget is kept: together they trace each preset's quality-vs-memory curve.

One memory level says little: a config tuned at 0.9 of DynamicCache may lose at 0.15, where users
compress. :func:`compare_levels` therefore also matches the selected config (its thresholds, the
budget changed) and every preset to each of several memory levels (``--holdout-levels``, default
0.15 and 0.30 of DynamicCache), one small table per level.

The selected config is either calibrated or, when no trial beat it, the base config itself (the study's
verdict): its rows are labelled by that verdict (:func:`selected_kind`), so a table never calls the base
"calibrated". Memory ratios are printed with :data:`MEMORY_DIGITS` decimals and a budget reaches a memory
when it does at that precision (:func:`fits`), so "cannot reach 0.6182" never sits beside "lowest: 0.6182".
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
from hfkv.config import TriStateConfig
from hfkv.presets import PRESETS


def _row(label: str, kind: str, ev: Evaluation, budget: int | None = None) -> dict:
    return {"config": label, "kind": kind, "budget": budget, **ev.to_dict()}


DEFAULT_LEVELS = (0.15, 0.30)
MEMORY_DIGITS = 4  # memory ratios in every line and table of the comparison
SELECTED_KINDS = ("calibrated", "base (selected)")  # the kind of the selected config's rows, by verdict


def selected_kind(verdict: str | None) -> str:
    """The label of the selected config's rows: ``calibrated`` only when the study's verdict says a calibrated
    config beat the base; with verdict ``base`` the config compared is the base itself."""
    return "calibrated" if verdict == "calibrated" else "base (selected)"


def is_selected(row: dict) -> bool:
    return row.get("kind") in SELECTED_KINDS


def fits(memory: float, target: float) -> bool:
    """Whether ``memory`` is at most ``target`` at the printed precision: a difference the report cannot show
    (0.61823 against 0.61819) is equal memory, not a failure to reach it."""
    return round(memory, MEMORY_DIGITS) <= round(target, MEMORY_DIGITS)


def _mem(x: float) -> str:
    return f"{x:.{MEMORY_DIGITS}f}"


def _config_key(cfg: TriStateConfig) -> str:
    """What an evaluation depends on: the config without its name and provenance."""
    return json.dumps({**cfg.key_dict(), "name": "", "provenance": {}}, sort_keys=True, default=str)


def _better(metric: str) -> Callable[[float, float], bool]:
    return (lambda a, b: a <= b) if METRICS[metric][1] == "minimize" else (lambda a, b: a >= b)


def _versus(sel: dict, sel_kind: str, other: dict, metric: str, same: bool = False) -> str:
    """One comparison line that says what was compared with what, and which won (``same``: ``other`` is the
    selected config itself, e.g. the base preset at the selected budget, so there is nothing to win)."""
    what = "the base" if sel_kind != "calibrated" else "calibrated"
    if same:
        return (
            f"{_label(other)} is the selected config itself ({what}): {metric} {sel[metric]:.4g} at memory "
            f"{_mem(sel['memory_ratio'])}"
        )
    wins = _better(metric)(sel[metric], other[metric])
    winner = "selected better or equal" if wins else f"{_label(other)} better"
    return (
        f"selected {_label(sel)} ({what}; {metric} {sel[metric]:.4g}, memory {_mem(sel['memory_ratio'])}) vs "
        f"{_label(other)} ({metric} {other[metric]:.4g}, memory {_mem(other['memory_ratio'])}): {winner}"
    )


def _label(row: dict) -> str:
    """A row's config with its budget (``hfkv@85``), unless the name already carries it or it has none."""
    name, budget = row["config"], row.get("budget")
    return name if budget is None or "@" in name else f"{name}@{budget}"


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
        key = _config_key(cfg)
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
        return "refused" if row is None else ("below" if fits(row["memory_ratio"], target) else "above")

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
    kind: str = "calibrated",
) -> dict:
    """Full cache, the selected config (labelled ``kind``: :func:`selected_kind` of the verdict), and each
    entry of ``others`` (a preset, matched by budget, or a YAML file, evaluated as is) on the same problems."""
    full = evaluate(TriStateConfig.from_preset("full"))
    sel = evaluate(selected)
    sel_row = _row(selected.name, kind, sel, selected.budget)
    rows = [_row("full", "reference", full), sel_row]
    curves: dict[str, list[dict]] = {}
    verdicts = {}
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
                lowest = points[0] if points else None
                verdicts[other] = f"no budget tried reaches the selected config's memory {_mem(sel.memory_ratio)}" + (
                    f" (lowest: {_mem(lowest['memory_ratio'])} at budget {lowest['budget']})" if lowest else ""
                )
            else:
                rows.append(chosen)
                same = _config_key(budgeted(other)(chosen["budget"])) == _config_key(selected)
                verdicts[other] = _versus(sel_row, kind, chosen, metric, same)
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
    kind: str = "calibrated",
) -> list[dict]:
    """At each memory level: the selected config (labelled ``kind``) and each of ``others`` (presets, or YAML
    configs with their budget changed) at the largest budget whose memory is <= the level, with the full cache.

    The search starts at ``level x longest`` (a budget in full-precision tokens of that size holds about
    that share of the longest sequence) and doubles, halves and bisects from there (``steps`` evaluations
    per method and level). A method that cannot get down to a level is listed as such, not dropped."""
    full = _row("full", "reference", evaluate(TriStateConfig.from_preset("full")))
    methods: list[tuple[str, str, str | TriStateConfig]] = [(selected.name, kind, selected)]
    for other in others:
        if other in PRESETS:
            methods.append((other, "preset", other))
        else:
            cfg = TriStateConfig.from_yaml(other)
            methods.append((cfg.name, "config", cfg))
    out = []
    for level in levels:
        rows, missing = [full], {}
        for name, row_kind, spec in methods:
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
                    "message": f"no budget tried reaches memory {_mem(level)}"
                    + (f" (lowest: {_mem(lowest['memory_ratio'])} at budget {lowest['budget']})" if points else ""),
                }
            else:
                key = _config_key(budgeted(spec)(chosen["budget"]))
                rows.append({**chosen, "config": name, "kind": row_kind, "_key": key})
        sel = next((r for r in rows if is_selected(r)), None)
        verdicts = {}
        for r in rows:
            if r["kind"] in ("preset", "config") and sel is not None:
                verdicts[r["config"]] = _versus(sel, kind, r, metric, r["_key"] == sel["_key"])
        rows = [{k: v for k, v in r.items() if k != "_key"} for r in rows]
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
                _mem(r["memory_ratio"]),
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
        [
            r["config"],
            r["kind"],
            "-" if r.get("budget") is None else str(r["budget"]),
            *(f"{r[m]:.4f}" for m in metrics),
            _mem(r["memory_ratio"]),
        ]
        for r in result["rows"]
    ]
    lines = _grid(["config", "kind", "budget", *metrics, "memory"], rows)
    lines += [f"{k}: {v}" for k, v in result["verdicts"].items()]
    return "\n".join(lines)


def plot(result: dict, path) -> Path:
    import matplotlib  # optional: the [calibrate] extra (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: the [calibrate] extra (matplotlib)

    from hfkv.calibration.report import save_figure  # deferred: report imports optuna (the [calibrate] extra)

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
            if is_selected(r):
                label = f"{r['config']} ({r['kind']})"
                ax.scatter([r["memory_ratio"]], [r[m]], marker="*", s=200, c="C3", zorder=5, label=label)
            elif r["kind"] == "reference":
                ax.scatter([r["memory_ratio"]], [r[m]], marker="s", c="k", label="full cache")
            elif r["kind"] == "config":
                ax.scatter([r["memory_ratio"]], [r[m]], marker="D", s=50, zorder=4, label=r["config"])
            elif r["kind"] == "preset default":
                ax.scatter([r["memory_ratio"]], [r[m]], marker="x", s=50, c="0.3")
        for j, lv in enumerate(result.get("levels", [])):
            ax.axvline(lv["level"], ls=":", c="0.5", lw=1)
            matched = [r for r in lv["rows"] if is_selected(r)]
            ax.scatter(
                [r["memory_ratio"] for r in matched],
                [r[m] for r in matched],
                marker="*",
                s=120,
                c="C3",
                edgecolors="k",
                zorder=5,
                label="selected at the memory levels" if j == 0 else None,
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
