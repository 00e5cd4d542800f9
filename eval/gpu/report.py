"""The GPU check's outputs (eval/gpu/check.py): the JSON, a one-screen summary and a figure, from the parts' results.

A lease's output is read once, quickly, often from the tail of a log: the summary puts what failed
or was skipped next to the figures it concerns, and the JSON (rewritten after every result, so a
killed run keeps what it measured) holds everything the summary leaves out.
"""

from __future__ import annotations

import io
import json
import re
import textwrap
from pathlib import Path
from typing import Any


def error_text(exc: BaseException) -> str:
    """The exception's first line and where it was raised: the innermost frame of hfkv and the innermost
    of all, so a failure on a lent GPU (minutes, once) can be fixed from its JSON alone."""
    import traceback

    text = str(exc).strip().splitlines()
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/hfkv/" in f.filename.replace("\\", "/")]
    where = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in (ours[-1:] + frames[-1:]) if f]
    at = f" [at {' <- '.join(dict.fromkeys(reversed(where)))}]" if where else ""
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}{at}"


GIB = 1 << 30
JSON_NAME, PNG_NAME, SUMMARY_NAME = "gpu_check.json", "gpu_check.png", "summary.txt"
MAX_LISTED = 6  # failures and skipped items named in the summary; the JSON has them all


def header(args, device: str, budget, deadlines: dict[str, float]) -> dict[str, Any]:
    """What ran, where and how: the fields every gpu_check.json starts with (``deadlines``: the check's
    :data:`~eval.gpu.check.DEADLINES`, passed in: this module is below the check and imports nothing of it)."""
    import torch
    import triton

    from hfkv.evaluation.results import provenance
    from hfkv.kernels.decode_attention import launch_defaults

    cuda = device == "cuda"
    name = torch.cuda.get_device_name(0) if cuda else "cpu (dry run: Triton's interpreter)"
    out: dict[str, Any] = {
        "dry_run": bool(args.dry_run),
        "device": name,
        "device_kind": device,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "budget_s": budget.total_s,
        "deadlines": dict(deadlines),
        "decode_launch": launch_defaults(),  # the defaults every decode call here used
        "parts": {},
        **provenance(machine=name),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out["device_memory_bytes"] = int(props.total_memory)
        out["multiprocessors"] = props.multi_processor_count
    return out


def _short(label: str) -> str:
    """A cache's label without the Triton backend every hfkv cache here runs on."""
    return re.sub(r":backend=triton(?=$| )", "", label.replace(",backend=triton", ""))


def _tests_lines(body: dict[str, Any]) -> list[str]:
    lines = []
    py = body.get("pytest")
    if py:
        how = "interpreter" if py.get("interpreter") else "compiled"
        cut = ", stopped at its time limit" if py.get("timed_out") else ""
        lines.append(
            f"pytest, Triton launches on {py['device']} ({how}): {py['passed']} passed, {py['failed']} failed, "
            f"{py['error']} errors, {py['skipped']} skipped in {py['seconds']:.0f} s{cut}"
        )
        if py.get("returncode") not in (0, None) and not py["failed"] and not py["error"]:
            lines.append(f"  pytest exited {py['returncode']}: {py['output_tail'].strip().splitlines()[-1:]}")
        for f in py["failures"][:MAX_LISTED]:
            msg = [m for m in f["message"].strip().splitlines() if m.startswith("E ")][:1] or [""]
            lines.append(f"  {f['outcome'].upper()} {f['test']} {msg[0][:110]}")
        not_run = py.get("not_run") or []  # runs before the collected line: absent
        if not_run:
            lines.append(f"  NOT RUN {len(not_run)} of {py['collected']} selected: {', '.join(not_run[:MAX_LISTED])}")
    checks = body.get("checks", [])
    if checks:
        bad = [c for c in checks if not c["ok"]]
        lines.append(f"on-device checks: {len(checks) - len(bad)} passed, {len(bad)} failed")
        lines += [f"  FAILED {c['name']}: {c['detail'][:120]}" for c in bad[:MAX_LISTED]]
    return lines


def _bandwidth_lines(body: dict[str, Any]) -> list[str]:
    copy = body.get("copy_bandwidth", {}).get("gbps")
    shape = body.get("shape", {})
    lines = [
        f"copy {copy:.0f} GB/s (read + write); one layer, {shape.get('heads')} query / {shape.get('kv_heads')} KV "
        f"heads x {shape.get('head_dim')}, bf16, one new token"
        if copy
        else "no copy bandwidth"
    ]
    rows = body.get("rows", [])
    if rows:
        lines.append("  kind   context  B       ms  read GB/s  of copy   SDPA ms  speed-up  bytes ratio  check")
    for r in rows:
        head = f"  {r['kind']:<6} {r['context']:>7} {r['batch']:>2}"
        if r.get("status") != "ok":
            lines.append(f"{head}  {r.get('status')}: {str(r.get('reason'))[:80]}")
            continue
        sd = r.get("sdpa", {})
        sdpa = f"{sd['ms']:9.3f}" if "ms" in sd else f"{'-':>9}"
        speed = f"{r['speedup_vs_sdpa']:8.2f}x" if "speedup_vs_sdpa" in r else f"{'-':>9}"
        ratio = f"{r['bytes_ratio_vs_sdpa']:10.2f}x" if "bytes_ratio_vs_sdpa" in r else f"{'-':>11}"
        chk = r.get("check", {})
        chk_s = ("ok" if chk.get("ok") else "FAIL") + f" {chk.get('rel_err', float('nan')):.0e}" if chk else ""
        lines.append(
            f"{head} {r['ms']:8.3f} {r['read_gbps']:9.0f} {r['read_fraction']:8.0%} {sdpa} {speed} {ratio}  {chk_s}"
        )
    bw = body.get("targets", {}).get("kernel_bandwidth", {})
    met = [f"{k} {_met(v)}" for k, v in bw.items() if isinstance(v, dict)]
    if met:
        lines.append(f"  target {bw.get('target')}: " + ", ".join(met))
    return lines


def _met(v: dict[str, Any]) -> str:
    if v.get("met") is None:
        return "not measured"
    return f"{'met' if v['met'] else 'NOT met'} (min {v['min']:.0%})"


def _e2e_lines(body: dict[str, Any]) -> list[str]:
    m = body.get("model")
    lines = []
    if m:
        lines.append(
            f"random {m['shape']} ({m['layers']} layers, {m['kv_heads']} KV heads x {m['head_dim']}), {m['dtype']}, "
            f"weights {m['weights_bytes'] / GIB:.1f} GiB; {_peak_title(body.get('rows', [])).split(',')[0]}"
        )
    rows = body.get("rows", [])
    if rows:
        lines.append(
            "  context  B  cache                     prefill s   step ms med / mean   peak GiB  KV GiB  compr  speed-up"
            "  in turns med / mean"
        )
    for r in rows:
        head = f"  {r['context']:>7} {r['batch']:>2}  {_short(r['method']):<24}"  # "hfkv@1024 graphed-steps"
        if r.get("status") != "ok":
            lines.append(f"{head} {r.get('status')}: {str(r.get('reason'))[:80]}")
            continue
        sp = f"{r['decode_speedup_median']:.2f}x" if "decode_speedup_median" in r else "-"
        turns = "-"
        if "decode_speedup_median_interleaved" in r:
            turns = f"{r['decode_speedup_median_interleaved']:.2f}x / {r['decode_speedup_mean_interleaved']:.2f}x"
        elif "interleaved" in r:
            turns = f"{r['interleaved']['decode_ms_median']:.2f} / {r['interleaved']['decode_ms_mean']:.2f} ms"
        if r.get("steps_that_compiled"):
            turns += f"  ({r['steps_that_compiled']} timed step(s) compiled a kernel: the mean is not steady)"
        if r.get("policy_runs"):
            turns += f"  (layers' runs {r['policy_runs']}, {r['runs_ahead']} prepared ahead)"
        lines.append(
            f"{head} {r['prefill_s']:9.2f} {r['decode_ms_median']:10.2f} / {r['decode_ms_mean']:<8.2f}"
            f" {r['peak_bytes'] / GIB:9.2f} {r['kv_bytes'] / GIB:7.2f} {r['compression'] or 0:5.1f}x {sp:>8}"
            f"  {turns}"
        )
    mb = body.get("max_batch") or {}
    if mb:
        parts = []
        for label, e in mb.items():
            if e.get("predicted") is None:
                parts.append(f"{_short(label)} -")
                continue
            how = {True: "confirmed", False: "predicted; a trial there ran out of memory", None: "predicted"}
            parts.append(f"{_short(label)} {e['predicted']} ({how[e.get('confirmed')]})")
        context = next(iter(mb.values())).get("context")
        lines.append(f"  largest batch at {context}: " + ", ".join(parts))
    q = body.get("quantized_cache")
    if q:
        lines.append(f"  QuantizedCache: {q['note']}")
    return lines


def summarize(result: dict[str, Any]) -> str:
    """The one-screen text: what ran, each part's figures, failures and skips."""
    ver = f"torch {result.get('torch')}, triton {result.get('triton')}, transformers {result.get('transformers')}"
    commit = result.get("git_commit") or "no git"
    if result.get("source_digest"):
        commit += f", sources {result['source_digest']}"
    lines = [f"hfkv gpu_check on {result['device']} ({ver}; hfkv {result.get('hfkv_version')} {commit})"]
    if result.get("dry_run"):
        lines.append("DRY RUN: CPU, Triton's interpreter, toy sizes; the numbers only show that every part runs")
    lines.append(f"time: {result.get('elapsed_s', 0):.0f} s of a {result['budget_s']:.0f} s budget")
    titles = {"tests": "TESTS", "bandwidth": "BANDWIDTH", "e2e": "END TO END"}
    render = {"tests": _tests_lines, "bandwidth": _bandwidth_lines, "e2e": _e2e_lines}
    for part, title in titles.items():
        body = result["parts"].get(part)
        if body is None:
            continue
        state = {"running": "still running, ", "error": f"ERROR {body.get('error')}, "}.get(body.get("status"), "")
        lines.append(f"{title} ({state}{body.get('seconds', 0):.0f} s)")
        lines += ["  " + x for x in render[part](body)]
    skipped = result.get("skipped", [])
    if skipped:
        lines.append(f"SKIPPED ({len(skipped)})")
        for s in skipped[:MAX_LISTED]:
            lines.append(f"  {s['part']}: {s['item']}: {s['reason'][:110]}")
        if len(skipped) > MAX_LISTED:
            lines.append(f"  ... and {len(skipped) - MAX_LISTED} more in {JSON_NAME}")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Kernel bandwidth per storage kind (top) and end-to-end step time and peak per cache (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hfkv.atomic import write_atomic

    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5), squeeze=False)
    bw = result["parts"].get("bandwidth") or {}
    copy = (bw.get("copy_bandwidth") or {}).get("gbps")
    rows = [r for r in bw.get("rows", []) if r.get("status") == "ok"]
    cmap = plt.get_cmap("viridis")
    batches = sorted({r["batch"] for r in rows})
    for j, kind in enumerate(("full", "quant", "hfkv")):
        ax = axes[0][j]
        for i, b in enumerate(batches):
            rs = sorted((r for r in rows if r["kind"] == kind and r["batch"] == b), key=lambda r: r["context"])
            if not rs:
                continue
            color = cmap(i / max(1, len(batches) - 1))
            ax.plot([r["context"] for r in rs], [r["read_fraction"] for r in rs], "o-", color=color, label=f"B={b}")
            sd = [r for r in rs if "read_gbps" in r.get("sdpa", {}) and copy]
            if sd:
                x = [r["context"] for r in sd]
                ax.plot(x, [r["sdpa"]["read_gbps"] / copy for r in sd], ":", color=color, label=f"SDPA B={b}")
        ax.axhline(0.8, color="red", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{kind}: bytes read / time / copy bandwidth", fontsize=9)
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
        if rows:
            ax.legend(fontsize=7)
    e2e = [r for r in (result["parts"].get("e2e") or {}).get("rows", []) if r.get("status") == "ok"]
    groups = sorted({(r["context"], r["batch"]) for r in e2e})
    methods = list(dict.fromkeys(r["method"] for r in e2e))
    width = 0.8 / max(1, len(methods))
    for ax, key, scale, title in (
        (axes[1][0], "decode_ms_median", 1.0, "decode step, median ms (mean: black tick)"),
        (axes[1][1], "peak_bytes", 1 / GIB, _peak_title(e2e)),
    ):
        for k, m in enumerate(methods):
            by = {(r["context"], r["batch"]): r for r in e2e if r["method"] == m}
            xs = [i + k * width for i, g in enumerate(groups) if g in by]
            ys = [by[g][key] * scale for g in groups if g in by]
            ax.bar(xs, ys, width, label=_short(m))
            if key == "decode_ms_median":
                ax.plot(xs, [by[g]["decode_ms_mean"] for g in groups if g in by], "k_", ms=8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [f"{_tokens(c)} x {b}" for c, b in groups])
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        if methods:
            ax.legend(fontsize=7)
    axes[1][2].axis("off")
    tests = [w for line in _tests_lines(result["parts"].get("tests") or {}) for w in textwrap.wrap(line, 58)]
    axes[1][2].text(0, 1, "\n".join(tests[:24]), va="top", fontsize=7, family="monospace")
    title = f"hfkv gpu_check on {result['device']}"
    if copy:
        title += f" (copy bandwidth {copy:.0f} GB/s)"
    if result.get("dry_run"):
        title += " - DRY RUN, toy sizes"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _peak_title(rows: list[dict[str, Any]]) -> str:
    if rows and rows[0].get("peak_kind") == "cache_bytes_held":
        return "peak: bytes the cache held, GiB"
    return "peak memory above the weights, GiB"


def write(out_dir: Path, result: dict[str, Any], budget, final: bool) -> str:
    """Rewrite the JSON and the summary (and, at the end, the figure); returns the summary text."""
    from hfkv.atomic import write_atomic
    from hfkv.evaluation.results import json_safe

    out_dir.mkdir(parents=True, exist_ok=True)
    result["elapsed_s"] = round(budget.elapsed(), 1)
    result["skipped"] = list(budget.skipped)
    result["complete"] = final
    if final:
        try:
            plot(result, out_dir / PNG_NAME)
        except Exception as exc:  # noqa: BLE001 - the JSON and the summary matter more than the figure
            result["plot_error"] = f"{type(exc).__name__}: {exc}"
    text = summarize(result)
    result["summary"] = text
    write_atomic(out_dir / JSON_NAME, json.dumps(json_safe(result), indent=1, sort_keys=True, default=str) + "\n")
    write_atomic(out_dir / SUMMARY_NAME, text)
    return text
