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
import hashlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass

import optuna
import torch
from optuna.trial import TrialState
from tqdm.auto import tqdm

from hfkv.calibration import storage as st
from hfkv.calibration.data import Selection, data_hash, load_problems, select
from hfkv.calibration.granularity import head_statistics
from hfkv.calibration.objectives import (
    DEFAULT_METRIC,
    METRICS,
    AccuracyObjective,
    FidelityObjective,
    encode,
    generate_solutions,
)
from hfkv.calibration.search import (
    BASE_POINT,
    SPEC_VERSION,
    SearchSpace,
    check_spec,
    directions,
    format_params,
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
        if v is None or v < 1:
            raise ValueError(f"--{name.replace('_', '-')}={v} must be >= 1")
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
        if solution_source(args) == "generated":  # a reference-solution study keeps its spec (and resumes)
            evaluation |= {"solutions": "generated", "max_new_tokens": max_new_tokens(args)}
    else:
        evaluation |= {"max_new_tokens": max_new_tokens(args), "batch_size": args.batch_size}
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
        "base": {k: v for k, v in base.key_dict().items() if k != "provenance"},
        "base_points": base_budgets,
    }
    spec = json.loads(json.dumps(spec))  # what the storage will hand back (lists, not tuples)
    name = args.study_name or default_study_name(args, metric)
    storage = st.open_storage(args.storage, name, args.studies_dir)
    return Context(args, selection, base, space, metric, dirs, spec, name, storage)


DEFAULT_MAX_NEW_TOKENS = {"fidelity": 1024, "accuracy": 512}


def solution_source(args: argparse.Namespace) -> str | None:
    """What the fidelity objective teacher-forces: ``"reference"`` (the data's solutions, cut to
    ``--max-solution-tokens``: short studies) when that option is given, else ``"generated"`` (the model's
    own greedy solutions of up to ``--max-new-tokens``, generated once per study). None for accuracy."""
    if args.objective != "fidelity":
        return None
    return "reference" if args.max_solution_tokens is not None else "generated"


def max_new_tokens(args: argparse.Namespace) -> int:
    return args.max_new_tokens if args.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS[args.objective]


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
    from hfkv.loading import load_model  # deferred: tests patch hfkv.loading.load_model

    device = ctx.args.device
    if device == "auto":
        device = f"cuda:{index % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    return load_model(ctx.args.model, gguf_file=ctx.args.gguf_file, dtype=ctx.args.dtype, device=device)


def make_objective(ctx: Context, model, tok, problems, solutions=None):
    a = ctx.args
    if a.objective == "fidelity":
        return FidelityObjective(
            model, tok, problems, a.chunk, a.max_solution_tokens, a.prompt, a.n_shots, solutions=solutions
        )
    return AccuracyObjective(model, tok, problems, max_new_tokens(a), a.batch_size, a.prompt, a.n_shots)


SOLUTIONS = "generated_solutions"  # user attribute prefix of the stored solutions


def ensure_solutions(
    ctx: Context, study: optuna.Study, model, tok, problems, which: str = "calibration", progress: bool = False
) -> list[list[int]] | None:
    """The model's own greedy solutions of ``problems`` (``which``: "calibration" or "holdout"), generated
    once per study with the full cache and stored in the study's user attributes, so every trial, every
    worker (on any machine sharing the storage) and every resume teacher-forces the same tokens. None when
    the study teacher-forces the data's reference solutions (``--max-solution-tokens``) or measures accuracy.

    Generated under the study lock by the first worker that needs them; the others wait on the lock and
    then read them. Stored as one attribute per problem (small rows, whatever the storage) and a manifest
    written last, with the sha256 of the token ids: a worker killed half-way leaves no manifest, so the
    solutions are regenerated (greedy: the same tokens) instead of read incomplete."""
    if solution_source(ctx.args) != "generated":
        return None

    a = ctx.args
    want = {
        "problems_sha256": data_hash(problems),
        "n": len(problems),
        "max_new_tokens": max_new_tokens(a),
        "prompt": a.prompt,
        "n_shots": a.n_shots,
    }
    key = f"{SOLUTIONS}:{which}"

    def stored() -> list[list[int]] | None:
        attrs = study.user_attrs
        manifest = attrs.get(key)
        if not manifest or {k: manifest.get(k) for k in want} != want:
            return None
        sols = [attrs.get(f"{key}:{i}") for i in range(len(problems))]
        if any(x is None for x in sols) or _ids_hash(sols) != manifest["sha256"]:
            return None
        return sols

    sols = stored()
    if sols is not None:
        return sols
    with ctx.storage.lock():
        sols = stored()  # another worker may have generated them while we waited
        if sols is not None:
            return sols
        started = time.time()
        sols = generate_solutions(model, tok, problems, max_new_tokens(a), a.prompt, a.n_shots, progress)
        for i, ids in enumerate(sols):
            study.set_user_attr(f"{key}:{i}", [int(t) for t in ids])
        lengths = [len(x) for x in sols]
        study.set_user_attr(key, {**want, "sha256": _ids_hash(sols), "lengths": lengths})
        print(
            f"generated {len(sols)} {which} solutions with the full cache in {time.time() - started:.0f}s "
            f"(tokens: min {min(lengths)}, mean {sum(lengths) / len(lengths):.0f}, max {max(lengths)}; "
            f"--max-new-tokens {max_new_tokens(a)}); stored with the study",
            file=sys.stderr,
        )
        return sols


def _ids_hash(sols) -> str:
    return hashlib.sha256(json.dumps([[int(t) for t in x] for x in sols]).encode()).hexdigest()


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


_terminating = threading.Event()


def _on_sigterm(signum, frame):
    # Also kept as a flag: a handler that runs inside a finalizer or a C callback has its exception swallowed,
    # and the worker would then finish the trial and exit 0 as if no signal had come.
    _terminating.set()
    raise _Terminated()


def _raise_if_terminating() -> None:
    if _terminating.is_set():
        raise _Terminated()


def run_worker(
    args: argparse.Namespace, index: int = 0, loaded=None, progress: bool | None = None, ctx: Context | None = None
) -> int:
    """Claim and evaluate trials until the study holds ``--n-trials`` finished ones; returns how many ran here."""
    if args.threads:
        torch.set_num_threads(args.threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    progress = (not args.no_progress) if progress is None else progress
    ctx = ctx or prepare(args)
    study = open_study(ctx)
    c = st.counts(study)
    if c.finished >= args.n_trials and not c.running:
        return 0  # finished: no model needed
    model, tok = loaded() if callable(loaded) else (loaded or load(ctx, index))
    solutions = ensure_solutions(ctx, study, model, tok, ctx.selection.calibration, "calibration", progress)
    objective = make_objective(ctx, model, tok, ctx.selection.calibration, solutions)
    ensure_references(ctx, study, objective, model, tok, progress)
    stats = study.user_attrs.get("head_stats")
    n_existing = len(study.get_trials(deepcopy=False))
    sampler = make_sampler(args.sampler, args.seed + 7919 * index + n_existing, ctx.constrained, len(ctx.space.params))
    pruner = make_pruner(args.pruner, len(ctx.selection.calibration), len(ctx.directions))
    study = optuna.load_study(study_name=ctx.study_name, storage=ctx.storage.storage, sampler=sampler, pruner=pruner)

    done_here, failures = 0, 0
    c = st.counts(study)
    bar = tqdm(
        total=args.n_trials,
        initial=min(c.finished, args.n_trials),
        desc=f"trials [{ctx.study_name}]",
        unit="trial",
        position=index,
        disable=not progress,
    )
    try:
        while True:
            _raise_if_terminating()
            trial = None
            with ctx.storage.lock():
                st.fail_stale(study, args.grace_period, args.max_retry)
                c = st.counts(study)
                # Queued trials (base points, retries) are taken first, but never past --n-trials: base points
                # left over when the study is small stay queued and run when it is extended.
                if c.finished + c.running < args.n_trials:
                    trial = study.ask()
                    st.mark_started(study, trial._trial_id)
                elif c.finished >= args.n_trials:
                    break
            bar.n = min(c.finished, args.n_trials)
            bar.refresh()
            if trial is None:  # only other workers' trials are left: wait for them (or for them to go stale)
                time.sleep(min(args.heartbeat_interval, 5))
                continue
            started = time.time()
            try:
                with st.Heartbeat(study._storage, trial._trial_id, args.heartbeat_interval):
                    values = _evaluate(ctx, trial, objective, stats, progress and args.n_workers == 1)
                _raise_if_terminating()
            except (KeyboardInterrupt, _Terminated):
                _finish(study, trial, None, "interrupted")
                raise
            except optuna.TrialPruned as exc:
                failures = 0
                if _finish(study, trial, None, None, pruned=True):
                    done_here += 1
                    bar.write(
                        f"trial {trial.number} [{ctx.study_name}]: pruned ({exc}) in {time.time() - started:.0f}s",
                        file=sys.stderr,
                    )
                continue
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
                bar.write(
                    f"trial {trial.number} [{ctx.study_name}]: {_short(metrics, ctx.metric)} "
                    f"({format_params(trial.params)}) in {time.time() - started:.0f}s",
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
    base_point = bool(trial.user_attrs.get(BASE_POINT))
    if base_point:  # the base itself (its point only approximates it, e.g. alpha tables)
        overrides = ctx.space.base_overrides(point, ctx.base)
    else:
        overrides = ctx.space.overrides(point, ctx.base, stats)
    trial.set_user_attr("config", overrides)
    cfg = dataclasses.replace(ctx.base, name=f"trial{trial.number}", provenance={}, **overrides)
    # Base points are never pruned (they are the verdict's evidence) but record their running values: they
    # are the first yardstick of the pruner.
    pruning = getattr(ctx.args, "pruner", "none") != "none"
    on_problem = _Pruning(ctx, trial, may_prune=not base_point) if pruning else None
    ev = objective.evaluate(cfg, progress, on_problem=on_problem) if on_problem else objective.evaluate(cfg, progress)
    metrics = ev.to_dict()
    trial.set_user_attr("metrics", metrics)
    values, constraint = objective_values(ctx.metric, metrics, ctx.args.max_memory_ratio, ctx.args.min_quality)
    if constraint is not None:
        trial.set_user_attr("constraint", constraint)
    return values


RUNNING = "running"  # user attribute: {step: [quality, memory_ratio]} of the problems seen so far


class _Pruning:
    """``on_problem`` of an objective: after problem ``i``, report the running objective and stop the trial
    (``optuna.TrialPruned``) if the pruner says so.

    Single-objective studies (``--max-memory-ratio`` / ``--min-quality``) use Optuna's own machinery:
    ``trial.report(value, step=i)`` and ``trial.should_prune()`` with the study's pruner. Optuna refuses
    both for a multi-objective study (the default: quality and memory), so there the median rule is applied
    here, to the running quality, with a guard for the Pareto front: a trial is pruned only if its running
    quality is worse than the median of the finished trials' at the same step AND its running memory is not
    below their median memory (a trial that is worse because it holds less memory may be on the front)."""

    def __init__(self, ctx: Context, trial: optuna.Trial, may_prune: bool = True) -> None:
        self.ctx, self.trial, self.may_prune = ctx, trial, may_prune
        self.running: dict[str, list[float]] = {}

    def __call__(self, step: int, ev) -> None:
        ctx, trial = self.ctx, self.trial
        metrics = ev.to_dict()
        q, m = float(metrics[ctx.metric]), float(metrics["memory_ratio"])
        self.running[str(step)] = [q, m]
        trial.set_user_attr(RUNNING, self.running)
        last = step >= len(ctx.selection.calibration) - 1  # finished anyway: nothing left to save
        if len(ctx.directions) == 1:
            values, _ = objective_values(ctx.metric, metrics, ctx.args.max_memory_ratio, ctx.args.min_quality)
            trial.report(values[0], step=step)
            if self.may_prune and not last and trial.should_prune():
                raise optuna.TrialPruned(f"at problem {step + 1}: {ctx.metric}={q:.4g} memory={m:.3f}")
            return
        if self.may_prune and not last and self._median_says_prune(step, q, m):
            raise optuna.TrialPruned(
                f"at problem {step + 1}: {ctx.metric}={q:.4g} worse than the median at memory {m:.3f} >= the median"
            )

    def _median_says_prune(self, step: int, q: float, m: float) -> bool:
        n_problems = len(self.ctx.selection.calibration)
        startup, warmup = pruner_settings(n_problems)
        if step < warmup:
            return False
        done = self.trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        seen = [t.user_attrs[RUNNING][str(step)] for t in done if str(step) in t.user_attrs.get(RUNNING, {})]
        if len(done) < startup or not seen:
            return False

        q_med = statistics.median(s[0] for s in seen)
        m_med = statistics.median(s[1] for s in seen)
        worse = q > q_med if METRICS[self.ctx.metric][1] == "minimize" else q < q_med
        return worse and m >= m_med


def pruner_settings(n_problems: int) -> tuple[int, int]:
    """``(n_startup_trials, n_warmup_steps)`` of the median pruner: 5 finished trials (the base points count)
    before anything is pruned, and at least a quarter of the problems (at least 1 step) seen by a trial."""
    return 5, max(1, n_problems // 4)


def make_pruner(kind: str, n_problems: int, n_objectives: int = 1) -> optuna.pruners.BasePruner:
    """Optuna's pruner of ``--pruner`` (steps = problems); for a multi-objective study only NopPruner, since
    there :class:`_Pruning` applies its own median rule."""
    if kind == "none" or n_objectives > 1:
        return optuna.pruners.NopPruner()
    if kind == "median":
        startup, warmup = pruner_settings(n_problems)
        return optuna.pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=warmup)
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(1, n_problems), reduction_factor=3)
    raise ValueError(f"--pruner={kind!r} must be one of {list(PRUNERS)}")


PRUNERS = ("none", "median", "hyperband")


def _finish(study: optuna.Study, trial: optuna.Trial, values, reason: str | None, pruned: bool = False) -> bool:
    """Tell the storage; False if the trial was already finished elsewhere (failed as stale by another worker)."""
    try:
        if pruned:
            study.tell(trial, state=TrialState.PRUNED)
        elif values is None:
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
