"""The selected config against the shipped presets at equal memory, on problems held out from calibration.

A preset's memory is set by its ``budget``; we search the largest budget whose memory ratio on the
held-out problems is at most the calibrated config's (doubling/halving from the preset's own
budget, then bisection), so "better" means better quality at equal or lower memory. Every
evaluated budget is kept: together they trace each preset's quality-vs-memory curve.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from hfkv.calibration.objectives import METRICS, Evaluation
from hfkv.calibration.search import least_valid_budget
from hfkv.config import PRESETS, TriStateConfig


def _row(label: str, kind: str, ev: Evaluation, budget: int | None = None) -> dict:
    return {"config": label, "kind": kind, "budget": budget, **ev.to_dict()}


def match_budget(
    evaluate: Callable[[TriStateConfig], Evaluation],
    preset: str,
    target: float,
    start: int,
    steps: int = 6,
) -> tuple[list[dict], dict | None]:
    """Evaluated points of ``preset`` at several budgets, and the largest budget with memory <= ``target``."""
    least = least_valid_budget(lambda b: TriStateConfig.from_preset(preset, budget=b))
    seen: dict[int, dict] = {}

    def mem(b: int) -> float:
        if b not in seen:
            cfg = TriStateConfig.from_preset(preset, budget=b)
            seen[b] = _row(f"{preset}@{b}", "matched", evaluate(cfg), b)
        return seen[b]["memory_ratio"]

    below = above = None
    b = max(start, least)
    if mem(b) <= target:
        below = b
        while len(seen) < steps:
            nb = b * 2
            if mem(nb) > target:
                above = nb
                break
            if seen[nb]["memory_ratio"] == seen[b]["memory_ratio"]:  # saturated: longer budgets keep everything
                below = nb
                break
            below = b = nb
    else:
        above = b
        while len(seen) < steps and b > least:
            b = max(least, b // 2)
            if mem(b) <= target:
                below = b
                break
            above = b
    while below is not None and above is not None and above - below > 1 and len(seen) < steps:
        mid = (below + above) // 2
        if mem(mid) <= target:
            below = mid
        else:
            above = mid
    points = sorted(seen.values(), key=lambda r: r["memory_ratio"])
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


def table(result: dict) -> str:
    metrics = [m for m in ("kl", "top1", "accuracy") if m in result["rows"][0]]
    head = ["config", "kind", *metrics, "memory"]
    rows = [
        [r["config"], r["kind"], *(f"{r[m]:.4f}" for m in metrics), f"{r['memory_ratio']:.4f}"] for r in result["rows"]
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    lines = [fmt(head), "-" * (sum(widths) + 2 * (len(widths) - 1)), *map(fmt, rows)]
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
        ax.set_xlabel("KV memory / DynamicCache")
        ax.set_ylabel({"kl": "mean KL to full cache (nats)", "top1": "top-1 agreement"}.get(m, m))
        if m == "kl":
            ax.set_yscale("symlog", linthresh=1e-3)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("held-out problems (x: preset defaults)")
    path = save_figure(fig, path)
    plt.close(fig)
    return path
