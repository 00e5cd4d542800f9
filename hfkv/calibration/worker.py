"""Running a study: one worker's trial loop, and ``--n-workers`` local worker processes.

Every worker (a local process, or a command started on another machine against the same
storage) does the same thing: open the study and check its spec, make sure the study-wide
references exist, then claim trials under the study lock until the study holds ``--n-trials``
finished trials. A worker that finds only other workers' trials still running waits for them:
if their worker died, their heartbeat goes stale and this worker re-runs them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

from hfkv.calibration import storage as st
from hfkv.calibration.data import Selection, load_problems, select
from hfkv.calibration.granularity import head_statistics
from hfkv.calibration.objectives import (
    DEFAULT_METRIC,
    METRICS,
    AccuracyObjective,
    FidelityObjective,
    encode,
)
from hfkv.calibration.search import (
    BASE_POINT,
    SPEC_VERSION,
    SearchSpace,
    check_spec,
    directions,
    load_base,
    make_sampler,
    objective_values,
)
from hfkv.config import TriStateConfig


@dataclass
class Context:
    """Everything a worker or the reporting step needs, built from the command line alone (no model)."""

    args: argparse.Namespace
    selection: Selection
    base: TriStateConfig
    space: SearchSpace
    metric: str
    directions: list[str]
    spec: dict
    study_name: str
    storage: st.Storage

    @property
    def constrained(self) -> bool:
        return self.args.max_memory_ratio is not None or self.args.min_quality is not None


def _slug(text: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "-" for c in os.path.basename(text.rstrip("/")) or text)
    return keep.strip("-.").lower() or "model"


def default_study_name(args: argparse.Namespace, metric: str) -> str:
    parts = [_slug(args.model), args.objective]
    if metric != DEFAULT_METRIC[args.objective]:
        parts.append(metric)
    parts.append(args.granularity)
    return "-".join(parts)


def prepare(args: argparse.Namespace) -> Context:
    """Validate the options, load and split the data, open the storage. Cheap: no model is loaded."""
    metric = args.metric or DEFAULT_METRIC[args.objective]
    dirs = directions(metric, args.max_memory_ratio, args.min_quality)  # validates the metric name
    if METRICS[metric][0] != args.objective:
        raise ValueError(f"--metric={metric!r} belongs to the {METRICS[metric][0]!r} objective, not {args.objective!r}")
    for name in ("n_trials", "n_workers", "heartbeat_interval", "grace_period"):
        v = getattr(args, name)
        if v is None or v < (0 if name == "n_trials" else 1):
            raise ValueError(f"--{name.replace('_', '-')}={v} must be >= {0 if name == 'n_trials' else 1}")
    if args.grace_period <= args.heartbeat_interval:
        raise ValueError(
            f"--grace-period={args.grace_period} must exceed --heartbeat-interval={args.heartbeat_interval}, "
            "or live trials would be failed as stale"
        )
    rows, source = load_problems(args.data_file, args.subjects)
    selection = select(rows, args.n_problems, args.seed, args.levels, args.subjects, args.holdout, source)
    base = load_base(args.base)
    space = SearchSpace(args.granularity, args.search or (), args.range or (), base)
    # The base's own config, queued at these budgets when the study is created (None: its own budget).
    base_budgets = space.base_budgets(base, args.base_points) if args.warm_start else []
    evaluation = {"prompt": args.prompt, "n_shots": args.n_shots}
    if args.objective == "fidelity":
        evaluation |= {"chunk": args.chunk, "max_solution_tokens": args.max_solution_tokens}
    else:
        evaluation |= {"max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size}
    spec = {
        "version": SPEC_VERSION,
        "model": args.model,
        "gguf_file": args.gguf_file,
        "dtype": args.dtype,
        "objective": args.objective,
        "metric": metric,
        "directions": dirs,
        "max_memory_ratio": args.max_memory_ratio,
        "min_quality": args.min_quality,
        "data": {
            "source": selection.source,
            "sha256": selection.hash,
            "n_problems": len(selection.calibration),
            "levels": args.levels,
            "subjects": args.subjects,
        },
        "evaluation": evaluation,
        "space": space.describe(),
        "base": {k: v for k, v in base.to_dict().items() if k != "provenance"},
        "base_points": base_budgets,
    }
    spec = json.loads(json.dumps(spec))  # what the storage will hand back (lists, not tuples)
    name = args.study_name or default_study_name(args, metric)
    storage = st.open_storage(args.storage, name, args.studies_dir)
    return Context(args, selection, base, space, metric, dirs, spec, name, storage)


def open_study(ctx: Context, sampler: optuna.samplers.BaseSampler | None = None) -> optuna.Study:
    """Create or load the study; on creation store its spec and queue the base config as the first trial(s).

    The spec and the base points are written together, under the study lock, by whichever worker finds
    the study without a spec: so the base is queued exactly once per study, however many workers start
    together and however often the study is resumed or extended."""
    study = optuna.create_study(
        study_name=ctx.study_name,
        storage=ctx.storage.storage,
        directions=ctx.directions,
        sampler=sampler,
        load_if_exists=True,
    )
    if study.user_attrs.get("spec") == ctx.spec:
        return study
    with ctx.storage.lock():
        stored = study.user_attrs.get("spec")
        check_spec(stored, ctx.spec, ctx.study_name)
        if stored is None:
            study.set_user_attr("spec", ctx.spec)
            with warnings.catch_warnings():  # experimental in Optuna, but only labels the dashboard's axes
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names(
                    [ctx.metric, "memory_ratio"]
                    if len(ctx.directions) == 2
                    else ["memory_ratio" if ctx.args.min_quality is not None else ctx.metric]
                )
            for budget in ctx.spec["base_points"]:
                point = ctx.space.base_point(ctx.base) | ({} if budget is None else {"budget": budget})
                study.enqueue_trial(point, user_attrs={BASE_POINT: ctx.base.name})
            if not ctx.spec["base_points"]:
                print(
                    "note: --no-warm-start: the base config is not queued, so the verdict cannot compare the "
                    "selected config with it",
                    file=sys.stderr,
                )
    return study


def load(ctx: Context, index: int = 0):
    """``(model, tokenizer)`` on this worker's device."""
    import torch

    from hfkv.loading import load_model

    device = ctx.args.device
    if device == "auto":
        device = f"cuda:{index % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    return load_model(ctx.args.model, gguf_file=ctx.args.gguf_file, dtype=ctx.args.dtype, device=device)


def make_objective(ctx: Context, model, tok, problems):
    a = ctx.args
    if a.objective == "fidelity":
        return FidelityObjective(model, tok, problems, a.chunk, a.max_solution_tokens, a.prompt, a.n_shots)
    return AccuracyObjective(model, tok, problems, a.max_new_tokens, a.batch_size, a.prompt, a.n_shots)


def ensure_references(ctx: Context, study: optuna.Study, objective, model, tok, progress: bool) -> None:
    """Full-cache quality (and, for layer/head granularity, the head statistics), once per study."""
    need_stats = ctx.space.granularity != "global"
    attrs = study.user_attrs
    if "reference" in attrs and (not need_stats or "head_stats" in attrs):
        return
    with ctx.storage.lock():
        attrs = study.user_attrs  # another worker may have computed them while we waited
        if "reference" not in attrs:
            ev = objective.evaluate(TriStateConfig.from_preset("full"), progress)
            study.set_user_attr("reference", ev.to_dict())
        if need_stats and "head_stats" not in attrs:
            a = ctx.args
            items = getattr(objective, "items", None) or encode(
                tok, ctx.selection.calibration, a.prompt, a.n_shots, a.max_solution_tokens
            )
            study.set_user_attr("head_stats", head_statistics(model, items, ctx.base, a.chunk, progress))


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so the running trial is marked failed before the worker exits."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def run_worker(
    args: argparse.Namespace, index: int = 0, loaded=None, progress: bool | None = None, ctx: Context | None = None
) -> int:
    """Claim and evaluate trials until the study holds ``--n-trials`` finished ones; returns how many ran here."""
    import torch
    from tqdm.auto import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    progress = (not args.no_progress) if progress is None else progress
    ctx = ctx or prepare(args)
    study = open_study(ctx)
    c = st.counts(study)
    if args.n_trials == 0 or (c.complete >= args.n_trials and not c.running):
        return 0  # finished: no model needed
    model, tok = loaded() if callable(loaded) else (loaded or load(ctx, index))
    objective = make_objective(ctx, model, tok, ctx.selection.calibration)
    ensure_references(ctx, study, objective, model, tok, progress)
    stats = study.user_attrs.get("head_stats")
    n_existing = len(study.get_trials(deepcopy=False))
    sampler = make_sampler(args.sampler, args.seed + 7919 * index + n_existing, ctx.constrained, len(ctx.space.params))
    study = optuna.load_study(study_name=ctx.study_name, storage=ctx.storage.storage, sampler=sampler)

    done_here, failures = 0, 0
    c = st.counts(study)
    bar = tqdm(
        total=args.n_trials,
        initial=min(c.complete, args.n_trials),
        desc=f"trials [{ctx.study_name}]",
        unit="trial",
        position=index,
        disable=not progress,
    )
    try:
        while True:
            trial = None
            with ctx.storage.lock():
                st.fail_stale(study, args.grace_period, args.max_retry)
                c = st.counts(study)
                # Queued trials (base points, retries) are taken first, but never past --n-trials: base points
                # left over when the study is small stay queued and run when it is extended.
                if c.complete + c.running < args.n_trials:
                    trial = study.ask()
                    st.mark_started(study, trial._trial_id)
                elif c.complete >= args.n_trials:
                    break
            bar.n = min(c.complete, args.n_trials)
            bar.refresh()
            if trial is None:  # only other workers' trials are left: wait for them (or for them to go stale)
                time.sleep(min(args.heartbeat_interval, 5))
                continue
            started = time.time()
            try:
                with st.Heartbeat(study._storage, trial._trial_id, args.heartbeat_interval):
                    values = _evaluate(ctx, trial, objective, stats, progress and args.n_workers == 1)
            except (KeyboardInterrupt, _Terminated):
                _finish(study, trial, None, "interrupted")
                raise
            except Exception as exc:  # a config the model cannot run, out of memory, ...
                failures += 1
                trial.set_user_attr("error", f"{type(exc).__name__}: {exc}")
                _finish(study, trial, None, "error")
                traceback.print_exc()
                if failures >= args.max_failures:
                    raise RuntimeError(
                        f"{failures} trials failed in a row on this worker (last: {exc}); see the errors above"
                    ) from exc
                continue
            failures = 0
            if _finish(study, trial, values, None):
                done_here += 1
                metrics = trial.user_attrs.get("metrics", {})
                bar.set_postfix_str(_short(metrics, ctx.metric))
                params = " ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items()
                )
                bar.write(
                    f"trial {trial.number} [{ctx.study_name}]: {_short(metrics, ctx.metric)} "
                    f"({params}) in {time.time() - started:.0f}s",
                    file=sys.stderr,
                )
    finally:
        bar.close()
    return done_here


def _short(metrics: dict, metric: str) -> str:
    if not metrics:
        return ""
    return f"{metric}={metrics.get(metric, float('nan')):.4g} mem={metrics.get('memory_ratio', float('nan')):.3f}"


def _evaluate(ctx: Context, trial: optuna.Trial, objective, stats, progress: bool) -> list[float]:
    point = ctx.space.sample(trial)
    if trial.user_attrs.get(BASE_POINT):  # the base itself (its point only approximates it, e.g. alpha tables)
        overrides = ctx.space.base_overrides(point, ctx.base)
    else:
        overrides = ctx.space.overrides(point, ctx.base, stats)
    trial.set_user_attr("config", overrides)
    cfg = dataclasses.replace(ctx.base, name=f"trial{trial.number}", provenance={}, **overrides)
    ev = objective.evaluate(cfg, progress)
    metrics = ev.to_dict()
    trial.set_user_attr("metrics", metrics)
    values, constraint = objective_values(ctx.metric, metrics, ctx.args.max_memory_ratio, ctx.args.min_quality)
    if constraint is not None:
        trial.set_user_attr("constraint", constraint)
    return values


def _finish(study: optuna.Study, trial: optuna.Trial, values, reason: str | None) -> bool:
    """Tell the storage; False if the trial was already finished elsewhere (failed as stale by another worker)."""
    try:
        if values is None:
            trial.set_user_attr("failed_reason", reason)
            study.tell(trial, state=TrialState.FAIL)
        else:
            study.tell(trial, values)
        return True
    except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError, ValueError) as exc:
        print(f"trial {trial.number}: could not be finished ({exc}); its retry will run it again", file=sys.stderr)
        return False


def _worker_main(args: argparse.Namespace, index: int) -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        run_worker(args, index)
    except (KeyboardInterrupt, _Terminated):
        sys.exit(130)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


def run_workers(args: argparse.Namespace) -> list[int]:
    """Start ``--n-workers`` local processes (spawned: each loads its own model) and wait for them.

    Returns their exit codes; a worker killed by a signal reports ``-signal``.
    """
    import multiprocessing as mp

    if not args.threads:
        args.threads = max(1, (os.cpu_count() or 1) // args.n_workers)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker_main, args=(args, i), name=f"hfkv-calibrate-{i}") for i in range(args.n_workers)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        for p in procs:  # they got SIGINT too; give them time to mark their trials failed
            p.join(timeout=30)
        raise
    return [p.exitcode for p in procs]
