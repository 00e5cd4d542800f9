"""Global vs per-layer vs per-head thresholds at equal memory, from the exports of finished studies.

    .venv/bin/python calibration/compare_granularity.py hfkv-out/calibrate/studies/<global> \\
        hfkv-out/calibrate/studies/<layer> hfkv-out/calibrate/studies/<head>

writes ``hfkv-out/compare_granularity/granularity.*`` by default; the committed results are regenerated only
by naming them (``--out calibration/results/granularity-smollm2``).

Each argument is a study's output folder (``summary.json``, written by ``hfkv calibrate``). The studies
must share model, data and objective (checked) and differ in ``--granularity``. "At equal memory"
is read off the trials: for each memory level on a common grid, the best quality any trial of a
study reaches at that memory or less (the study's Pareto front as a step function). A finer
granularity only wins where its front lies below (kl) / above (top1) the coarser one's. Writes
``<out>.json``, ``<out>.md`` (the table) and ``<out>.png``; all three come from the summaries alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere in the checkout
    sys.path.insert(0, str(REPO))

from hfkv.atomic import write_atomic  # noqa: E402
from hfkv.calibration.objectives import METRICS  # noqa: E402
from hfkv.calibration.report import dump_json, save_figure  # noqa: E402

SHARED = ("model", "gguf_file", "dtype", "objective", "data", "evaluation")
DEFAULT_OUT = Path("hfkv-out/compare_granularity/granularity")  # a user's folder, never calibration/results


def load(folder: Path) -> dict:
    path = folder / "summary.json"
    if not path.is_file():
        raise SystemExit(f"{folder}: no summary.json (run `hfkv calibrate` with --output-dir/--studies-dir first)")
    return json.loads(path.read_text())


def best_at(trials: list[dict], metric: str, memory: float) -> float | None:
    """Best ``metric`` among trials using at most ``memory`` (None if none fits)."""
    sign = 1.0 if METRICS[metric][1] == "minimize" else -1.0
    fits = [t["metrics"][metric] for t in trials if t["metrics"]["memory_ratio"] <= memory + 1e-12]
    return min(fits, key=lambda v: sign * v) if fits else None


def compare(summaries: dict[str, dict], metrics: list[str], n_levels: int = 8) -> dict:
    first = next(iter(summaries.values()))["spec"]
    for name, s in summaries.items():
        diff = [k for k in SHARED if s["spec"].get(k) != first.get(k)]
        if diff:
            raise SystemExit(f"{name}: differs from the first study in {diff}; compare studies of one setup only")
    trials = {
        name: [t for t in s["trials"] if t["state"] == "COMPLETE" and t.get("metrics")] for name, s in summaries.items()
    }
    # Memory grid: from the largest per-study minimum (every study has a point there) to the smallest maximum.
    lo = max(min(t["metrics"]["memory_ratio"] for t in ts) for ts in trials.values())
    hi = min(max(t["metrics"]["memory_ratio"] for t in ts) for ts in trials.values())
    grid = [lo + (hi - lo) * i / (n_levels - 1) for i in range(n_levels)] if hi > lo else [lo]
    rows = []
    for m in grid:
        row = {"memory_ratio": round(m, 4)}
        for name, ts in trials.items():
            for metric in metrics:
                row[f"{name}:{metric}"] = best_at(ts, metric, m)
        rows.append(row)
    wins = {}
    base = next(iter(trials))
    for name in list(trials)[1:]:
        for metric in metrics:
            sign = 1.0 if METRICS[metric][1] == "minimize" else -1.0
            pairs = [(r[f"{name}:{metric}"], r[f"{base}:{metric}"]) for r in rows]
            wins[f"{name} vs {base} ({metric})"] = {
                "better": sum(sign * a < sign * b for a, b in pairs),
                "equal": sum(a == b for a, b in pairs),
                "worse": sum(sign * a > sign * b for a, b in pairs),
            }
    return {
        "studies": {
            n: {"study": s["study"], "granularity": s["spec"]["space"]["granularity"]} for n, s in summaries.items()
        },
        "setup": {k: first.get(k) for k in SHARED},
        "reference": next(iter(summaries.values()))["reference"],
        "n_trials": {n: len(ts) for n, ts in trials.items()},
        "metrics": metrics,
        "grid": rows,
        "wins": wins,
        "points": {
            n: [{"number": t["number"], **{k: t["metrics"][k] for k in (*metrics, "memory_ratio")}} for t in ts]
            for n, ts in trials.items()
        },
    }


def table(result: dict) -> str:
    names, metrics = list(result["studies"]), result["metrics"]
    head = ["memory <=", *(f"{n} {m}" for m in metrics for n in names)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in result["grid"]:
        cells = [f"{r['memory_ratio']:.3f}"]
        for m in metrics:
            vals = {n: r[f"{n}:{m}"] for n in names}
            sign = 1.0 if METRICS[m][1] == "minimize" else -1.0
            best = min((v for v in vals.values() if v is not None), key=lambda v: sign * v, default=None)
            for n in names:
                v = vals[n]
                text = "—" if v is None else f"{v:.4f}"
                cells.append(f"**{text}**" if v is not None and v == best else text)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Trials per study: " + ", ".join(f"{n} {k}" for n, k in result["n_trials"].items()) + ".")
    for k, v in result["wins"].items():
        lines.append(
            f"- {k}: better at {v['better']}, equal at {v['equal']}, worse at {v['worse']} of the memory levels"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = result["metrics"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4.2), squeeze=False)
    for ax, m in zip(axes[0], metrics, strict=True):
        for i, (name, pts) in enumerate(result["points"].items()):
            ax.scatter([p["memory_ratio"] for p in pts], [p[m] for p in pts], s=12, c=f"C{i}", alpha=0.35)
            xs = sorted({p["memory_ratio"] for p in pts})
            ax.step(xs, [best_at([{"metrics": p} for p in pts], m, x) for x in xs], where="post", c=f"C{i}", label=name)
        ax.set_xlabel("KV memory / DynamicCache")
        ax.set_ylabel({"kl": "mean KL to full cache (nats)", "top1": "top-1 agreement"}.get(m, m))
        if m == "kl" and any(p[m] > 0 for pts in result["points"].values() for p in pts):
            ax.set_yscale("symlog", linthresh=1e-3)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("threshold granularity: best quality at equal or lower memory (calibration problems)")
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs="+", type=Path, help="output folders of studies (summary.json inside)")
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"output prefix: <out>.json, <out>.md, <out>.png (default: {DEFAULT_OUT})",
    )
    p.add_argument("--levels", type=int, default=8, help="memory levels in the table (default: 8)")
    a = p.parse_args(argv)
    summaries = {}
    for folder in a.studies:
        s = load(folder)
        summaries[s["spec"]["space"]["granularity"]] = s
    if len(summaries) != len(a.studies):
        raise SystemExit("give one study per granularity")
    objective = next(iter(summaries.values()))["spec"]["objective"]
    metrics = ["kl", "top1"] if objective == "fidelity" else ["accuracy"]
    result = compare(summaries, metrics, a.levels)
    write_atomic(a.out.with_suffix(".json"), dump_json(result))
    write_atomic(a.out.with_suffix(".md"), table(result))
    plot(result, a.out.with_suffix(".png"))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
