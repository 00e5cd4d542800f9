"""After the trials: the Pareto front, the selected config, plots and exports beside the study.

Selection rule (docs/calibration.md, "How a study works", **Selection.**): the smallest-memory trial whose
quality is within ``--tolerance`` of the full cache's (measured once per study). With ``--max-memory-ratio`` the
best-quality trial under that memory; with ``--min-quality`` the smallest-memory trial reaching it.
Under every rule a trial that holds more bytes than the full cache is never selected: the full cache
is exact with fewer (a large sampled budget on short calibration sequences compresses nothing, and
pages and per-token metadata then hold up to ~13% more than DynamicCache at ~120 tokens).
The base is a candidate (the base points of hfkv.calibration.search): :func:`choose` never ships a config
that a base point matches or beats at equal or lower memory on the calibration problems; the base point
is shipped instead, with the verdict ``base`` (``calibrated`` when the selected config beats every base
point at its memory or below).
Everything written here is written atomically, so an interrupted report never leaves a
truncated file next to a good study.
"""

from __future__ import annotations

import csv
import io
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import optuna
import torch
import transformers
from optuna.trial import FrozenTrial, TrialState

import hfkv
from hfkv.atomic import write_atomic
from hfkv.calibration.objectives import METRICS
from hfkv.calibration.search import BASE_POINT, format_params, quality_loss, quality_ok
from hfkv.config import TriStateConfig

DEFAULT_TOLERANCE = {"kl": 0.01, "top1": 0.01, "accuracy": 0.01}


# --------------------------------------------------------------------------- files
def save_figure(fig, path: str | os.PathLike) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    return write_atomic(path, buf.getvalue())


# --------------------------------------------------------------------------- trials
def finished(study: optuna.Study) -> list[FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if "metrics" in t.user_attrs]


def pareto_front(trials: Sequence[FrozenTrial], metric: str) -> list[FrozenTrial]:
    """Trials no other trial beats on both quality and memory, sorted by memory."""
    sign = 1.0 if METRICS[metric][1] == "minimize" else -1.0

    def key(t):
        m = t.user_attrs["metrics"]
        return sign * m[metric], m["memory_ratio"]

    pts = [(key(t), t) for t in trials]
    front = [t for (q, m), t in pts if not any(q2 <= q and m2 <= m and (q2 < q or m2 < m) for (q2, m2), _ in pts)]
    return sorted(front, key=lambda t: (t.user_attrs["metrics"]["memory_ratio"], t.number))


def select_trial(
    trials: Sequence[FrozenTrial],
    metric: str,
    reference: dict,
    tolerance: float,
    max_memory_ratio: float | None = None,
    min_quality: float | None = None,
) -> FrozenTrial | None:
    """The trial to ship (see the module docstring), or None when no trial qualifies."""
    sign = 1.0 if METRICS[metric][1] == "minimize" else -1.0

    def mem(t):
        return t.user_attrs["metrics"]["memory_ratio"]

    def q(t):
        return t.user_attrs["metrics"][metric]

    trials = [t for t in trials if mem(t) <= reference.get("memory_ratio", 1.0)]
    if max_memory_ratio is not None:
        ok = [t for t in trials if mem(t) <= max_memory_ratio]
        return min(ok, key=lambda t: (sign * q(t), mem(t), t.number), default=None)
    if min_quality is not None:
        ok = [t for t in trials if quality_ok(metric, q(t), min_quality)]
    else:
        ok = [t for t in trials if quality_loss(metric, q(t), reference[metric]) <= tolerance]
    return min(ok, key=lambda t: (mem(t), sign * q(t), t.number), default=None)


def is_base_point(t: FrozenTrial) -> bool:
    """Marked when queued (and kept by its retries), not inferred from the parameters: a base point's
    parameters only approximate the base (an alpha table, a value outside a --range), its config is exact."""
    return bool(t.user_attrs.get(BASE_POINT))


def _metrics_of(t: FrozenTrial, metric: str) -> dict:
    m = t.user_attrs["metrics"]
    out = {"trial": t.number, "budget": (t.user_attrs.get("config") or {}).get("budget")}
    return out | {k: m[k] for k in dict.fromkeys(("kl", "top1", "accuracy", metric, "memory_ratio")) if k in m}


@dataclass
class Verdict:
    """What the report ships: the trial, whether it is the base or a calibrated config, and the evidence."""

    trial: FrozenTrial | None
    verdict: str | None  # "calibrated" | "base" | None (no trial qualifies)
    base_best: FrozenTrial | None  # the best base point at the shipped trial's memory or below
    n_base: int  # finished base points
    metric: str
    base_name: str = "base"

    def message(self) -> str:
        """One line for the terminal and the config's provenance, with the numbers behind the verdict."""
        if self.trial is None:
            return "no trial qualifies under the selection rule"
        m = self.trial.user_attrs["metrics"]
        budget = (self.trial.user_attrs.get("config") or {}).get("budget")
        at = f"{self.metric} {m[self.metric]:.4g} at memory {m['memory_ratio']:.4f}"
        if self.verdict == "base":
            where = f" at budget {budget}" if budget is not None else ""
            return (
                f"no calibrated config beats the base ({self.base_name}) on the calibration problems: the base "
                f"is written{where} (trial {self.trial.number}: {at})"
            )
        if self.base_best is not None:
            b = self.base_best.user_attrs["metrics"]
            return (
                f"calibrated (trial {self.trial.number}: {at}) beats the best base point at equal or lower memory "
                f"(trial {self.base_best.number}: {self.metric} {b[self.metric]:.4g} at memory "
                f"{b['memory_ratio']:.4f})"
            )
        if self.n_base == 0:
            return f"calibrated (trial {self.trial.number}: {at}); no base point finished, so none to compare with"
        return f"calibrated (trial {self.trial.number}: {at}); every base point holds more memory"

    def record(self) -> dict:
        """The verdict's evidence, YAML/JSON-safe (the config's provenance, summary.json)."""
        return {
            "verdict": self.verdict,
            "message": self.message(),
            "base": self.base_name,
            "base_points": self.n_base,
            "selected": None if self.trial is None else _metrics_of(self.trial, self.metric),
            "best_base_at_or_below": None if self.base_best is None else _metrics_of(self.base_best, self.metric),
        }


def choose(
    trials: Sequence[FrozenTrial],
    metric: str,
    reference: dict,
    tolerance: float,
    max_memory_ratio: float | None = None,
    min_quality: float | None = None,
    base_name: str = "base",
) -> Verdict:
    """:func:`select_trial`, then the base rule: if a base point is at least as good at equal or lower
    memory, ship that base point instead (verdict ``base``). A calibrated config must beat the base where
    it is measured, or calibrating was not worth its risk (a threshold tuned on a few problems)."""
    sign = 1.0 if METRICS[metric][1] == "minimize" else -1.0
    full = reference.get("memory_ratio", 1.0)
    bases = [t for t in trials if is_base_point(t)]
    chosen = select_trial(trials, metric, reference, tolerance, max_memory_ratio, min_quality)
    if chosen is None:
        return Verdict(None, None, None, len(bases), metric, base_name)

    def mem(t):
        return t.user_attrs["metrics"]["memory_ratio"]

    def q(t):
        return sign * t.user_attrs["metrics"][metric]

    below = [b for b in bases if mem(b) <= min(mem(chosen), full)]
    best = min(below, key=lambda t: (q(t), mem(t), t.number), default=None)
    if best is not None and q(best) <= q(chosen):
        chosen = best  # a tie goes to the base: calibration must beat it, not match it
    verdict = "base" if is_base_point(chosen) else "calibrated"
    return Verdict(chosen, verdict, best, len(bases), metric, base_name)


# --------------------------------------------------------------------------- table
def _params(t: FrozenTrial) -> str:
    return format_params(t.params)


def pareto_table(front: Sequence[FrozenTrial], metrics: Sequence[str], selected: FrozenTrial | None) -> str:
    head = ["trial", *metrics, "memory", "params"]
    rows = [
        [
            f"{t.number}{'*' if selected is not None and t.number == selected.number else ''}",
            *(f"{t.user_attrs['metrics'][m]:.4f}" for m in metrics),
            f"{t.user_attrs['metrics']['memory_ratio']:.4f}",
            _params(t),
        ]
        for t in front
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    out = [line(head), "-" * (sum(widths) + 2 * (len(widths) - 1))] + [line(r) for r in rows]
    return "\n".join(out)


# --------------------------------------------------------------------------- plots
def plot_pareto(trials, front, selected, reference: dict, metrics: Sequence[str], path) -> Path:
    import matplotlib  # optional: the [calibrate] extra (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: the [calibrate] extra (matplotlib)

    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4.2), squeeze=False)
    for ax, m in zip(axes[0], metrics, strict=True):
        ax.scatter(
            [t.user_attrs["metrics"]["memory_ratio"] for t in trials],
            [t.user_attrs["metrics"][m] for t in trials],
            s=14,
            c="0.65",
            label="trials",
        )
        ax.plot(
            [t.user_attrs["metrics"]["memory_ratio"] for t in front],
            [t.user_attrs["metrics"][m] for t in front],
            "o-",
            ms=4,
            c="C0",
            label="Pareto front",
        )
        bases = [t for t in trials if is_base_point(t)]
        if bases:
            ax.scatter(
                [t.user_attrs["metrics"]["memory_ratio"] for t in bases],
                [t.user_attrs["metrics"][m] for t in bases],
                marker="x",
                s=40,
                c="C1",
                zorder=4,
                label="base config",
            )
        ax.scatter([reference["memory_ratio"]], [reference[m]], marker="s", c="k", label="full cache")
        if selected is not None:
            sm = selected.user_attrs["metrics"]
            ax.scatter(
                [sm["memory_ratio"]],
                [sm[m]],
                marker="*",
                s=180,
                c="C3",
                zorder=5,
                label=f"selected (trial {selected.number})",
            )
        ax.set_xlabel("KV memory / DynamicCache")
        ax.set_ylabel({"kl": "mean KL to full cache (nats)", "top1": "top-1 agreement"}.get(m, m))
        if m == "kl" and any(t.user_attrs["metrics"]["kl"] > 0 for t in trials):
            ax.set_yscale("symlog", linthresh=1e-3)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("calibration trials: quality vs memory")
    path = save_figure(fig, path)
    plt.close(fig)
    return path


def importances(study: optuna.Study, trials, metric: str) -> dict[str, dict[str, float]]:
    """fANOVA importance of each parameter for quality and for memory (needs >= 2 trials and >1 parameter)."""
    # deferred: optuna.importance takes ~1 s to import
    from optuna.importance import FanovaImportanceEvaluator, get_param_importances

    if len(trials) < 2:
        return {}
    names = {
        metric: lambda t: t.user_attrs["metrics"][metric],
        "memory_ratio": lambda t: t.user_attrs["metrics"]["memory_ratio"],
    }
    out = {}
    for name, target in names.items():
        try:
            imp = get_param_importances(study, evaluator=FanovaImportanceEvaluator(seed=0), target=target)
        except (RuntimeError, ValueError):  # e.g. every trial has the same value
            continue
        out[name] = {k: float(v) for k, v in imp.items()}
    return out


def plot_importances(imp: dict[str, dict[str, float]], path) -> Path | None:
    if not imp:
        return None
    import matplotlib  # optional: the [calibrate] extra (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: the [calibrate] extra (matplotlib)

    fig, axes = plt.subplots(
        1, len(imp), figsize=(4.5 * len(imp), 0.5 + 0.45 * max(len(v) for v in imp.values())), squeeze=False
    )
    for ax, (target, vals) in zip(axes[0], imp.items(), strict=True):
        names = list(vals)[::-1]
        ax.barh(names, [vals[n] for n in names], color="C0")
        ax.set_title(f"importance for {target}")
        ax.set_xlim(0, 1)
    fig.tight_layout()
    path = save_figure(fig, path)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- exports
def _trial_record(t: FrozenTrial) -> dict:
    return {
        "number": t.number,
        "state": t.state.name,
        "params": t.params,
        "metrics": t.user_attrs.get("metrics"),
        "config": t.user_attrs.get("config"),  # the config fields the trial set: the trial is rebuildable
        "worker": t.user_attrs.get("worker"),
        **{k: t.user_attrs[k] for k in ("retry_of", BASE_POINT, "error", "failed_reason") if k in t.user_attrs},
        "duration_s": t.duration.total_seconds() if t.duration else None,
    }


def trials_csv(study: optuna.Study, metrics: Sequence[str]) -> str:
    buf = io.StringIO()
    trials = study.get_trials(deepcopy=False)
    pnames = sorted({k for t in trials for k in t.params})
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["number", "state", *pnames, *metrics, "memory_ratio", "kv_bytes", "dense_bytes", "duration_s"])
    for t in trials:
        m = t.user_attrs.get("metrics") or {}
        w.writerow(
            [
                t.number,
                t.state.name,
                *(t.params.get(p, "") for p in pnames),
                *(m.get(k, "") for k in (*metrics, "memory_ratio", "kv_bytes", "dense_bytes")),
                t.duration.total_seconds() if t.duration else "",
            ]
        )
    return buf.getvalue()


def versions() -> dict[str, str]:
    return {
        "hfkv": str(hfkv.__version__),
        "torch": str(torch.__version__),
        "transformers": str(transformers.__version__),
        "optuna": str(optuna.__version__),
        "python": platform.python_version(),
    }


def now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


def write_config(
    path: str | os.PathLike,
    base: TriStateConfig,
    trial: FrozenTrial,
    name: str,
    provenance: dict,
    command: str | None = None,
) -> TriStateConfig:
    """The selected trial's config (base + the fields the trial set: only the budget for a base point) as
    YAML, with provenance, atomically."""
    cfg = TriStateConfig.from_dict(
        {**base.to_dict(), **trial.user_attrs["config"], "name": name, "provenance": provenance}
    )
    where = f"study {provenance['study']['name']}, trial {trial.number}"
    if is_base_point(trial):
        header = f"The base config {base.name!r}: no calibrated config beat it (`hfkv calibrate`, {where})."
    else:
        header = f"Calibrated by `hfkv calibrate` ({where})."
    if command:
        header += f"\nCommand: {command}"
    header += "\nLoad with TriStateConfig.from_yaml(path) or hfkv_config=<path>."
    cfg.to_yaml(path, header=header)
    return cfg


def summary(
    study,
    ctx_spec: dict,
    reference: dict,
    trials,
    front,
    selected,
    rule: dict,
    imp: dict,
    public_url: str,
    verdict: dict | None = None,
) -> dict:
    return {
        "study": study.study_name,
        "storage": public_url,
        "date": now_iso(),
        "spec": ctx_spec,
        "reference": reference,
        "counts": {s.name.lower(): sum(t.state == s for t in study.get_trials(deepcopy=False)) for s in TrialState},
        "selection": rule,
        "selected": None if selected is None else _trial_record(selected),
        "verdict": verdict,
        "pareto": [_trial_record(t) for t in front],
        "importance": imp,
        "head_stats": study.user_attrs.get("head_stats"),
        "trials": [_trial_record(t) for t in study.get_trials(deepcopy=False)],
    }


def dump_json(obj) -> str:
    return json.dumps(obj, indent=1, sort_keys=False, default=str) + "\n"
