"""The Optuna study: search space, objectives' directions, the study's spec and its one-time references.

Search space (docs/calibration.md: its opening paragraph, and "How a study works", **Search space and
granularity.**): ``alpha_h`` in [0, 5] or off (``alpha_h_off``: inf, the ``hfkv`` preset's own choice, which
no float range holds) and ``alpha_l`` in [0, 0.1], optionally
ARKV's ``tau1..3`` and ``gamma``, the ``budget``, the ``window`` and the tiers' ``fidelity`` (what a
memory budget values a mid or quantized token at: per model, since the built-in table is one guess
for all); ``--granularity layer|head`` adds the three shape parameters of
:mod:`hfkv.calibration.granularity`. ``alpha_l <= alpha_h`` and ``fidelity_quantized <=
fidelity_mid`` are kept by construction (clipped), so no sampled point is infeasible. The parameters and their
default ranges live in :mod:`hfkv.calibration.ranges` (torch- and optuna-free, for the command's parser).

The base config is a candidate of every study: it is queued as the first trial(s), at a few budgets
spanning the searched range when the budget is searched (:meth:`SearchSpace.base_budgets`), and such a
"base point" evaluates the base config exactly (only its budget replaced), so selection can always
compare a calibrated config with what not calibrating would have given (:func:`hfkv.calibration.report.choose`).

A study remembers what it measures (model, data hash, objective, base config, space) in its user
attributes; resuming with a different setup is refused instead of mixing incomparable trials. The
full-cache reference and the head statistics are computed once per study and stored there too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hfkv.calibration.granularity import GRANULARITIES, alpha_tables
from hfkv.calibration.objectives import METRICS
from hfkv.calibration.ranges import CHOICES, DEFAULT_RANGES, Choice, Param, parse_range
from hfkv.config import TriStateConfig
from hfkv.presets import PRESETS
from hfkv.suggest import did_you_mean

if TYPE_CHECKING:
    import optuna

# 2: alpha_h_off joined the space and the base points joined the spec (a version-1 study cannot be resumed).
SPEC_VERSION = 2
BASE_POINT = "base_point"  # user attribute of a trial that evaluates the base config (its value: the base's name)


OPTIONAL: dict[str, tuple[str, ...]] = {
    "tau": ("tau1", "tau2", "tau3"),
    "gamma": ("gamma",),
    "budget": ("budget",),
    "window": ("window",),
    "fidelity": ("fidelity_mid", "fidelity_quantized"),
}
SHAPE = ("beta_h", "beta_l", "delta")


class SearchSpace:
    """The searched parameters and how a point becomes a :class:`TriStateConfig`."""

    def __init__(
        self,
        granularity: str = "global",
        extra: Sequence[str] = (),
        ranges: Sequence[str] = (),
        base: TriStateConfig | None = None,
    ) -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"--granularity={granularity!r} must be one of {GRANULARITIES}")
        unknown = [e for e in extra if e not in OPTIONAL]
        if unknown:
            hint = did_you_mean(unknown[0], OPTIONAL)
            raise ValueError(f"--search: unknown group(s) {unknown}{hint}; allowed: {list(OPTIONAL)}")
        self.granularity = granularity
        names = ["alpha_h", "alpha_h_off", "alpha_l", *(SHAPE if granularity != "global" else ())]
        names += [n for group in OPTIONAL if group in extra for n in OPTIONAL[group]]
        if "fidelity" in extra:
            names = [n for n in names if n not in _unused_fidelities(base, "budget" in extra)]
        overrides = dict((n, (lo, hi)) for n, lo, hi in map(parse_range, ranges))
        stray = sorted(set(overrides) - set(names))
        if stray:
            raise ValueError(f"--range given for {stray}, which this search does not vary (searched: {names})")
        self.params: dict[str, Param | Choice] = {}
        for n in names:
            if n in CHOICES:
                self.params[n] = CHOICES[n]
                continue
            p = DEFAULT_RANGES[n]
            if n in overrides:
                lo, hi = overrides[n]
                if n.startswith("alpha") and lo < 0:
                    raise ValueError(f"--range {n}={lo}:{hi}: alphas are >= 0")
                if n.startswith("fidelity") and not 0 <= lo <= hi <= 1:
                    raise ValueError(f"--range {n}={lo}:{hi}: fidelities lie in [0, 1]")
                p = dataclasses.replace(p, low=lo, high=hi)
            self.params[n] = p

    def describe(self) -> dict:
        return {"granularity": self.granularity, "params": {n: p.to_list() for n, p in self.params.items()}}

    def sample(self, trial: optuna.Trial) -> dict:
        return {n: p.suggest(trial) for n, p in self.params.items()}

    def overrides(self, point: dict, base: TriStateConfig, stats: dict | None) -> dict:
        """The config fields a point sets (YAML-safe): alpha tables, and tau/gamma/window/budget if searched."""
        h, lo = alpha_tables(
            self.granularity,
            math.inf if point.get("alpha_h_off") else point["alpha_h"],
            point["alpha_l"],
            stats,
            point.get("beta_h", 0.0),
            point.get("beta_l", 0.0),
            point.get("delta", 0.0),
        )
        out: dict = {"alpha_h": h, "alpha_l": lo}
        if "tau1" in point:
            out["tau"] = [point["tau1"], point["tau2"], point["tau3"]]
        if "gamma" in point:
            out["gamma"] = point["gamma"]
        if "fidelity_quantized" in point:
            quantized = point["fidelity_quantized"]
            top = base.fidelity[0] if base.fidelity is not None else 1.0  # the original tier's, as the base has it
            if "fidelity_mid" in point:
                mid = min(point["fidelity_mid"], top)
                out["fidelity"] = [top, mid, min(quantized, mid)]
            else:
                out["fidelity"] = [top, min(quantized, top)]
        window = int(point.get("window", base.window))
        if "window" in point:
            out["window"] = window
        if "budget" in point:
            # The budget includes the window (and, per unit, its growth and the sinks): a sampled budget below
            # what the config accepts is raised to the least valid one.
            least = least_valid_budget(lambda b: dataclasses.replace(base, **out, budget=b))
            out["budget"] = max(int(point["budget"]), least)
        return out

    def config(self, point: dict, base: TriStateConfig, stats: dict | None, name: str) -> TriStateConfig:
        return dataclasses.replace(base, name=name, provenance={}, **self.overrides(point, base, stats))

    def base_point(self, base: TriStateConfig) -> dict:
        """The point of the space closest to ``base`` (without its budget): the base's own alphas (alpha_h
        off as ``alpha_h_off``), beta = delta = 0, its tau, gamma, window and fidelities.

        A base point evaluates ``base`` itself (:meth:`base_overrides`), so this only tells the sampler
        where the base lies; a value the space cannot hold (an alpha table, a value outside a --range, the
        built-in fidelity table) is recorded at the nearest point of its range, and a parameter that does
        not matter for the base (alpha_h when off) at its upper end, so the record is reproducible."""
        ps = self.params

        def at(name: str, value) -> float | int:
            p = ps[name]
            assert isinstance(p, Param)
            if isinstance(value, list):  # a per-layer or [layer][head] table: its mean finite entry
                flat = [x for row in value for x in (row if isinstance(row, list) else [row])]
                finite = [x for x in flat if math.isfinite(x)]
                value = sum(finite) / len(finite) if finite else math.inf
            return p.nearest(p.high if value is None or not math.isfinite(value) else value)

        off = isinstance(base.alpha_h, float) and math.isinf(base.alpha_h)
        point: dict = {
            "alpha_h": at("alpha_h", base.alpha_h),
            "alpha_h_off": off,
            "alpha_l": at("alpha_l", base.alpha_l),
        }
        point |= {n: 0.0 for n in SHAPE}
        point |= {f"tau{i + 1}": t for i, t in enumerate(base.tau)}
        point |= {"gamma": base.gamma, "window": base.window}
        fid = base.fidelity
        point |= {"fidelity_mid": fid[1] if fid is not None and len(fid) == 3 else None}
        point |= {"fidelity_quantized": fid[-1] if fid is not None else None}
        return {
            n: (v if isinstance(ps[n], Choice) else at(n, v)) for n, v in point.items() if n in ps and n != "budget"
        }

    def base_budgets(self, base: TriStateConfig, count: int) -> list[int | None]:
        """The budgets the base is queued at: its own when the budget is not searched ([None]), else
        ``count`` budgets spaced geometrically over the searched range (ends included), so the base is
        measured across the memory the search explores, not at one point. Budgets the base would raise
        to the same valid one are queued once."""
        if "budget" not in self.params:
            return [None]
        p = self.params["budget"]
        assert isinstance(p, Param)
        lo, hi = int(p.low), int(p.high)
        # A budget range is log-scale, so LO > 0 (Param refuses anything else).
        grid = [hi] if count <= 1 or lo == hi else [round(lo * (hi / lo) ** (i / (count - 1))) for i in range(count)]
        least = least_valid_budget(lambda b: dataclasses.replace(base, budget=b))
        out: list[int | None] = []
        seen: set[int] = set()
        for b in grid:
            b = min(max(int(b), lo), hi)
            if max(b, least) not in seen:
                seen.add(max(b, least))
                out.append(b)
        return out

    def base_overrides(self, point: dict, base: TriStateConfig) -> dict:
        """The fields a base point changes in ``base``: only the budget, when it is searched (raised to the
        least the base accepts, as for any trial)."""
        if "budget" not in point:
            return {}
        least = least_valid_budget(lambda b: dataclasses.replace(base, budget=b))
        return {"budget": max(int(point["budget"]), least)}


def _unused_fidelities(base: TriStateConfig | None, budget_searched: bool) -> tuple[str, ...]:
    """The fidelity parameters ``base`` would ignore (a searched value that changes nothing is refused,
    or, for the mid tier of a base without one, not searched)."""
    if base is None:
        raise ValueError("--search fidelity needs the base config (SearchSpace(..., base=...))")
    budget = base.budget is not None or budget_searched
    if not (base.compress and budget and base.budget_unit != "tokens"):
        raise ValueError(
            f"--search fidelity: fidelities weigh the tiers under a memory budget, and --base {base.name!r} has "
            f"budget={base.budget!r}, budget_unit={base.budget_unit!r} (allowed: a budget in 'fp_tokens' or "
            "'bytes', e.g. --base hfkv, or add --search budget)"
        )
    return () if base.mid is not None else ("fidelity_mid",)


def format_params(params: dict) -> str:
    """A trial's parameters as one line, as the config it ran holds them: with ``alpha_h_off`` the sampled
    ``alpha_h`` is a placeholder the config never sees (the config's alpha_h is inf), so printing it beside
    ``alpha_h_off=True`` would report a threshold that was not used."""
    shown = dict(params)
    if shown.pop("alpha_h_off", False):
        shown["alpha_h"] = "inf"
    ordered = {k: shown[k] for k in params if k in shown}
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in ordered.items())


def least_valid_budget(make: Callable[[int], TriStateConfig], limit: int = 1 << 40) -> int:
    """The smallest budget ``make(budget)`` accepts. Asked of the config itself, because the rule depends
    on the budget's unit, the window, the policy interval, sinks and slack (and may change with the policy)."""
    hi = 1
    while True:
        try:
            make(hi)
            break
        except ValueError:
            hi *= 2
            if hi > limit:
                raise
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            make(mid)
            hi = mid
        except ValueError:
            lo = mid
    return hi


def load_base(spec: str) -> TriStateConfig:
    """A preset name or a YAML path."""
    if spec in PRESETS:
        if spec == "full":
            raise ValueError("--base full compresses nothing, so no threshold matters; pick a compressing preset")
        return TriStateConfig.from_preset(spec)
    path = Path(spec)
    if not path.is_file():
        hint = did_you_mean(spec, PRESETS)
        raise ValueError(f"--base={spec!r} is neither a preset {PRESETS}{hint} nor an existing YAML file")
    return TriStateConfig.from_yaml(path)


# --------------------------------------------------------------------------- objectives of the study
def directions(metric: str, max_memory_ratio: float | None, min_quality: float | None) -> list[str]:
    """(quality, memory) by default; one objective when a constraint is given."""
    if metric not in METRICS:
        raise ValueError(f"--metric={metric!r} must be one of {list(METRICS)}")
    if max_memory_ratio is not None and min_quality is not None:
        raise ValueError(
            "give --max-memory-ratio or --min-quality, not both (each turns the other objective into a constraint)"
        )
    quality = METRICS[metric][1]
    if max_memory_ratio is not None:
        if not max_memory_ratio > 0:
            raise ValueError(f"--max-memory-ratio={max_memory_ratio} must be > 0")
        return [quality]
    if min_quality is not None:
        return ["minimize"]
    return [quality, "minimize"]


def quality_ok(metric: str, value: float, bound: float) -> bool:
    """Whether ``value`` of ``metric`` is at least as good as ``bound`` (<= for kl, >= otherwise)."""
    return value <= bound if METRICS[metric][1] == "minimize" else value >= bound


def quality_loss(metric: str, value: float, reference: float) -> float:
    """How much worse than the full cache (>= 0 means worse): kl - ref, or ref - top1/accuracy."""
    return value - reference if METRICS[metric][1] == "minimize" else reference - value


def objective_values(metric: str, metrics: dict, max_memory_ratio: float | None, min_quality: float | None):
    """``(values, constraint)`` for ``study.tell`` and the constrained sampler (constraint <= 0: feasible)."""
    q, m = metrics[metric], metrics["memory_ratio"]
    if max_memory_ratio is not None:
        return [q], [m - max_memory_ratio]
    if min_quality is not None:
        slack = q - min_quality if METRICS[metric][1] == "minimize" else min_quality - q
        return [m], [slack]
    return [q, m], None


def constraint_of(trial: optuna.trial.FrozenTrial) -> Sequence[float]:
    """Optuna ``constraints_func``: the ``constraint`` user attribute (<= 0 is feasible)."""
    return trial.user_attrs.get("constraint", [0.0])


def make_sampler(kind: str, seed: int, constrained: bool, n_params: int) -> optuna.samplers.BaseSampler:
    """TPE by default (multi-objective aware; constraint-aware when constrained)."""
    import optuna  # optional (the calibrate extra): importing this module must not need it

    cf = constraint_of if constrained else None
    if kind == "tpe":
        return optuna.samplers.TPESampler(
            seed=seed, multivariate=True, n_startup_trials=max(5, 2 * n_params), constraints_func=cf
        )
    if kind == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, constraints_func=cf)
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"--sampler={kind!r} must be one of ['tpe', 'nsga2', 'random']")


# --------------------------------------------------------------------------- study spec
class SpecMismatch(ValueError):
    pass


def check_spec(stored: dict | None, spec: dict, study_name: str) -> None:
    """Refuse to resume a study whose trials measured something else."""
    if stored is None:
        return
    diff = sorted(k for k in set(stored) | set(spec) if stored.get(k) != spec.get(k))
    if diff:
        details = "; ".join(f"{k}: stored {stored.get(k)!r} != now {spec.get(k)!r}" for k in diff)
        raise SpecMismatch(
            f"study {study_name!r} was created with a different setup ({details}). Its trials are not comparable: "
            "rerun with the original options, or pass a new --study-name"
        )
