"""Accuracy vs KV memory on the testbed tasks, for methods x budgets x dtypes -> a JSONL file (``--out``).

One row per (task, method, dtype, n): exact-match accuracy on the shipped test set (100 examples per
task unless --limit), KV bytes held per example, what a DynamicCache holds for the same tokens,
memory_ratio = kv / dense, compression = dense / kv, decode tokens/s, plus version, commit and date.
Rows already in the file are skipped unless --force, so an interrupted sweep resumes where it stopped;
a row whose method resolves to a different config than when it ran (a preset's defaults changed) is re-run
and replaced. After a code change that keeps configs (a policy fix), re-run with --force.
Methods are method specs (hfkv/evaluation/methods.py); a preset without '@' is run at every --budgets
value, '<preset>@none' without a budget. A run appends to ``hfkv-out/eval/testbed_sweep.jsonl`` under the working
directory unless ``--out`` names another file; the committed results are extended only when named. The default
command, with the committed file named, is the one the results were made with:

    OMP_NUM_THREADS=1 python eval/sweep_testbed.py --out eval/results/testbed_sweep.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT_METHODS = "dynamic,quanto-int4,quanto-int2,evict,quant,quant@none,streaming,arkv,diffkv,diffkv@none,hfkv"
DEFAULT_BUDGETS = "48,64,80,112,160"
KEY = ("task", "method", "dtype", "n")
MATCH = ("config", "options")  # a row whose method config changed since (new preset defaults) is re-run
OUT_DIR = "hfkv-out/eval"  # a run's default folder, under the working directory; eval/results/ only by --out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=[DEFAULT_METHODS], help="method specs (default: %(default)s)")
    ap.add_argument(
        "--budgets",
        default=DEFAULT_BUDGETS,
        help="budgets per KV head: tokens, or full-precision-token equivalents for hfkv (default: %(default)s)",
    )
    ap.add_argument("--tasks", default="kv_recall,arith_cot", help="testbed tasks (default: kv_recall,arith_cot)")
    ap.add_argument("--dtypes", default="bf16,fp32", help="model dtypes, bf16 first (default: bf16,fp32)")
    ap.add_argument("--limit", type=int, default=100, help="examples per task (default 100 = the whole test set)")
    ap.add_argument("--batch-size", type=int, default=25, help="prompts per generate call, left padded (default 25)")
    ap.add_argument("--model", default="testbed", help="model spec for hfkv.loading.load_model (default: testbed)")
    ap.add_argument("--out", default=f"{OUT_DIR}/testbed_sweep.jsonl", help="result file (default: %(default)s)")
    ap.add_argument("--force", action="store_true", help="re-run rows already in --out")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable timings)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from hfkv.evaluation.methods import expand_methods, stored_row_as_today
    from hfkv.evaluation.results import ResultFile, git_commit, parse_list, provenance
    from hfkv.evaluation.testbed_eval import evaluate_method
    from hfkv.loading import load_model, parse_dtype
    from hfkv.testbed.tasks import TASKS, load_test_set

    git_commit()  # the commit of the code imported now, whatever is committed while the sweep runs
    torch.set_num_threads(args.threads)
    tasks = parse_list(args.tasks)
    for t in tasks:
        if t not in TASKS:
            raise SystemExit(f"--tasks: unknown task {t!r}; known: {sorted(TASKS)}")
    dtypes = parse_list(args.dtypes)
    for d in dtypes:
        parse_dtype(d)
    if args.limit < 1:
        raise SystemExit(f"--limit={args.limit} must be >= 1")
    methods, skipped = expand_methods(args.methods, parse_list(args.budgets))
    for spec, why in skipped:
        print(f"skipping {spec}: {why}", file=sys.stderr)
    out = ResultFile(args.out, KEY, MATCH, normalize=stored_row_as_today)
    data = {t: load_test_set(t)[: args.limit] for t in tasks}
    todo = [
        (d, t, m)
        for d in dtypes
        for t in tasks
        for m in methods
        if args.force or not out.has({"task": t, "dtype": d, "n": len(data[t]), **m.describe()})
    ]
    print(
        f"{len(todo)} rows to run ({len(methods)} methods x {len(tasks)} tasks x {len(dtypes)} dtypes, "
        f"{len(methods) * len(tasks) * len(dtypes) - len(todo)} already in {args.out})",
        flush=True,
    )
    model = tok = None
    current = None
    t_all = time.perf_counter()
    for i, (dtype, task, method) in enumerate(todo, 1):
        if current != dtype:
            model, tok = load_model(args.model, dtype=dtype, device=args.device)
            current = dtype
        t0 = time.perf_counter()
        r = evaluate_method(
            model,
            tok,
            task,
            data[task],
            method,
            batch_size=args.batch_size,
            progress=None if args.no_progress else f"[{i}/{len(todo)}] {task} {method.label} {dtype}",
        )
        row = {
            "task": task,
            "dtype": dtype,
            **method.describe(),
            **r,
            "batch_size": args.batch_size,
            "model": args.model,
            "wall_s": round(time.perf_counter() - t0, 2),
            **provenance(),
        }
        out.add(row)
        print(
            f"[{i}/{len(todo)}] {task:<9} {method.label:<16} {dtype:<4} acc={r['accuracy']:.3f} "
            f"mem={r['memory_ratio']:.3f} ({r['compression']:.2f}x) {row['wall_s']:.0f}s",
            flush=True,
        )
    print(f"done in {time.perf_counter() - t_all:.0f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
