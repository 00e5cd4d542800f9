"""eval/make_tables.py: the committed eval/README.md and README.md's demo table are what the script makes from
the committed result files; Pareto marks, thresholds, missing rows and aggregation checked on hand-made rows."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from eval import make_tables as mt

REPO = Path(__file__).resolve().parents[1]


def test_committed_markdown_is_reproduced_byte_for_byte():
    readme, demo = mt.render(REPO, plots=False)
    assert (REPO / "eval" / "README.md").read_text(encoding="utf-8") == readme
    top = (REPO / "README.md").read_text(encoding="utf-8")
    assert mt.replace_block(top, demo) == top
    assert mt.main(["--check"]) == 0  # docs/kernels.md's scaling block included


def test_pareto_matches_the_inspect_reference():
    import pandas as pd

    from hfkv.inspect import pareto_front

    rng = random.Random(0)
    for _ in range(20):
        pts = [(rng.choice([0.1, 0.2, 0.3, 0.5]), rng.choice([0.0, 0.5, 0.9, 1.0])) for _ in range(12)]
        frame = pd.DataFrame(pts, columns=["memory_ratio", "accuracy"])
        assert mt.pareto(pts) == pareto_front(frame).tolist()


def _row(task, method, acc, mem, preset=None, budget=None, dtype="bf16", n=100, **extra):
    return {
        "task": task,
        "method": method,
        "preset": preset or method,
        "budget": budget,
        "dtype": dtype,
        "n": n,
        "accuracy": acc,
        "memory_ratio": mem,
        "compression": 1 / mem,
        "kv_bytes": 1024 * 100 * mem,
        "dense_bytes": 1024 * 100,
        "decode_tok_s": 100.0,
        "wall_s": 60.0,
        "date": "2026-01-01T00:00:00Z",
        "git_commit": "abc",
        "hfkv_version": "0.1.0",
        **extra,
    }


@pytest.fixture
def root(tmp_path):
    rows = [
        _row("kv_recall", "dynamic", 1.0, 1.0),
        _row("kv_recall", "evict@80", 0.9, 0.18, "evict", 80),
        _row("kv_recall", "evict@160", 1.0, 0.30, "evict", 160),
        _row("kv_recall", "hfkv@80", 1.0, 0.15, "hfkv", 80),
        _row("kv_recall", "hfkv@80", 0.2, 0.15, "hfkv", 80, n=10),  # a smaller run: the n=100 row wins
        _row("kv_recall", "quanto-int2", 0.95, 0.16),
        _row("arith_cot", "dynamic", 1.0, 1.0),
        _row("arith_cot", "hfkv@80", 0.5, 0.5, "hfkv", 80),
    ]
    (tmp_path / "eval" / "results").mkdir(parents=True)
    (tmp_path / mt.TESTBED).write_text("".join(json.dumps(r) + "\n" for r in rows))
    fid = [
        {"model": "m", "texts": "t", "doc": d, "method": "evict@128", "preset": "evict", "budget": 128, "dtype": "fp32"}
        | {"chunk": 1, "kl": kl, "top1": 0.9, "kv_bytes": kv, "dense_bytes": 1000, "positions": 4, "wall_s": 1.0}
        for d, kl, kv in ((0, 0.1, 100), (1, 0.3, 300))
    ]
    (tmp_path / mt.FIDELITY).write_text("".join(json.dumps(r) + "\n" for r in fid))
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    return tmp_path


def test_tables_from_hand_made_rows(root):
    assert mt.main(["--root", str(root)]) == 0
    text = (root / "eval" / "README.md").read_text()
    assert text.index("### kv_recall (bf16)") < text.index("### arith_cot (bf16)")
    kv = text.split("### kv_recall (bf16)")[1].split("###")[0]
    # hfkv@80 (n=100) dominates evict@80 and quanto-int2; evict@160 is dominated by hfkv@80 too
    assert "| hfkv@80 | 100 | 1.000 | 15.0% | 6.67x | 15.0 | 100 | ✓ |" in kv
    assert "| evict@80 | 100 | 0.900 | 18.0% | 5.56x | 18.0 | 100 |  |" in kv
    assert "| dynamic | 100 | 1.000 | 100.0% | 1.00x | 100.0 | 100 |  |" in kv
    assert "| evict | 0.900 (evict@80, 18.0%) | 1.000 (evict@160, 30.0%) |" in kv
    assert "| dynamic | — | — |" in kv
    assert "hfkv rows on the Pareto front: hfkv@80 (of 1)." in kv
    assert "hfkv@80 with 1.000 at 6.67x: met." in kv
    arith = text.split("### arith_cot (bf16)")[1].split("## ")[0]
    assert "Target: no hfkv row reaches 5x compression." in arith
    # fidelity: KL averaged over documents, memory weighted by bytes (400 / 2000)
    assert "| evict@128 | 2 | 0.2000 | 0.900 | 20.0% | ✓ |" in text
    assert "No files yet in `eval/results/bench/`" in text
    for name in ("testbed_kv_recall_bf16.png", "testbed_arith_cot_bf16.png", "fidelity_m_fp32.png"):
        assert (root / mt.PLOTS / name).read_bytes()[:4] == b"\x89PNG"
    # README: only the demo block changed; missing methods / budgets are dashes
    top = (root / "README.md").read_text()
    before = (REPO / "README.md").read_text()
    start, end = top.index(mt.DEMO_START), top.index(mt.DEMO_END)
    assert top[:start] == before[: before.index(mt.DEMO_START)]
    assert top[end:] == before[before.index(mt.DEMO_END) :]
    assert "No committed demo run yet" in top[start:end]
    # with a committed demo run: its rows in the demo's format, and how long it took on what
    run = {"date": "2026-01-01", "hfkv": "0.1.0", "torch": "2.13.0", "wall_s": 150.0, "cpu_count": 2}
    run |= {"machine": "x86_64", "threads": 2, "dtype": "float32", "load_average_before": 0.1}
    rows = [
        {"task": "kv_recall", "cache": c, "n": 100, "accuracy": a, "compression": x, "kv_kib": k}
        | {"decode_tok_s": 10.0}
        for c, a, x, k in (("DynamicCache", 1.0, 1.0, 100.0), ("hfkv@80", 0.5, 2.0, 50.0))
    ]
    (root / mt.DEMO).write_text(json.dumps({"run": run | {"load_average_after": 0.3}, "rows": rows}))
    assert mt.main(["--root", str(root)]) == 0
    demo = (root / "README.md").read_text()
    assert "kv_recall  DynamicCache      100     1.000        1.00x      100.0          10.0" in demo
    assert "kv_recall  hfkv@80           100     0.500        2.00x       50.0          10.0" in demo
    assert "2.5 min on 2 cores (x86_64), 2 torch threads, float32, load average 0.10 before / 0.30 after" in demo
    assert mt.main(["--root", str(root), "--check"]) == 0
    (root / mt.TESTBED).write_text((root / mt.TESTBED).read_text().replace('"accuracy": 0.9,', '"accuracy": 0.8,'))
    assert mt.main(["--root", str(root), "--check"]) == 1


def test_missing_markers_are_an_error():
    with pytest.raises(ValueError, match="results:demo-table:start"):
        mt.replace_block("no markers here", "x")


def _ruler(task, method, doc, score, mem, preset=None, budget=None, **extra):
    return {
        "model": "smollm2",
        "dtype": "bf16",
        "task": task,
        "length": 4096,
        "doc_id": doc,
        "method": method,
        "preset": preset or method,
        "budget": budget,
        "score": score,
        "memory_ratio": mem,
        "kv_bytes": 1000 * mem,
        "dense_bytes": 1000,
        "wall_s": 6.0,
        "date": "2026-01-02T00:00:00Z",
        "git_commit": "abc",
        "git_dirty": False,
        "hfkv_version": "0.1.0",
        "machine": "cpu",
        **extra,
    }


@pytest.fixture
def ruler_root(root):
    ev, hf = ("evict@256", "evict", 256), ("hfkv@256", "hfkv", 256)
    rows = [
        # niah_single_1: hfkv lacks doc 3 (scored on docs 0-2), the others have all four; doc 4 has no dynamic row
        *[_ruler("niah_single_1", "dynamic", d, 1.0, 1.0) for d in range(4)],
        _ruler("niah_single_1", *ev[:1], 0, 0.0, 0.14, *ev[1:]),  # replaced by the later row of the same key
        *[_ruler("niah_single_1", ev[0], d, s, 0.14, *ev[1:]) for d, s in ((0, 1.0), (1, 0.0), (2, 0.0), (3, 0.0))],
        *[
            _ruler("niah_single_1", hf[0], d, s, m, *hf[1:])
            for d, s, m in ((0, 1.0, 0.12), (1, 1.0, 0.12), (2, 0.5, 0.15))
        ],
        _ruler("niah_single_1", ev[0], 4, 1.0, 0.14, *ev[1:]),
        # niah_multikey_2: solved by the full cache (0.5), enters the average
        *[_ruler("niah_multikey_2", "dynamic", d, s, 1.0) for d, s in ((0, 1.0), (1, 0.0))],
        *[_ruler("niah_multikey_2", ev[0], d, 0.0, 0.14, *ev[1:]) for d in (0, 1)],
        *[_ruler("niah_multikey_2", hf[0], d, s, 0.13, *hf[1:]) for d, s in ((0, 1.0), (1, 0.0))],
        # ruler_vt: the full cache scores 0.2 < SOLVED, so the task is left out of the average
        *[_ruler("ruler_vt", "dynamic", d, s, 1.0) for d, s in ((0, 0.0), (1, 0.4))],
        *[_ruler("ruler_vt", m, d, 0.0, mem, p, b) for m, p, b, mem in (ev + (0.14,), hf + (0.13,)) for d in (0, 1)],
    ]
    (root / "eval" / "results" / "ruler_x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_ruler_tables_from_hand_made_rows(ruler_root):
    text, _ = mt.render(ruler_root, plots=False)
    sec = text.split("## RULER (lm-eval's offline tasks)")[1].split("\n## ")[0]
    assert text.index("## Real model: teacher-forced fidelity") < text.index("## RULER") < text.index("## Speed")
    assert (
        "From `eval/results/ruler_x.jsonl` (hfkv 0.1.0, commit(s) abc, 2026-01-02 to 2026-01-02; "
        "24 rows took 2.4 min on cpu)." in sec
    )
    heads = [line for line in sec.splitlines() if line.startswith("### ")]
    assert heads == [
        "### niah_multikey_2 at 4096 tokens (smollm2, bf16)",
        "### niah_single_1 at 4096 tokens (smollm2, bf16)",
        "### ruler_vt at 4096 tokens (smollm2, bf16)",
        "### Average over tasks the full cache solves at 4096 tokens (smollm2, bf16)",
        "### Best score per memory level at 4096 tokens (smollm2, bf16)",
    ]
    single = sec.split("### niah_single_1")[1].split("###")[0]
    # dynamic's docs 0-3 (doc 4 left out); hfkv has docs 0-2 only; Wilson at 4/4 = [4 / (4 + 1.96^2), 1];
    # evict's doc 0 is its last row (1.0); hfkv (13.0%, 0.833) dominates evict (14.0%, 0.25)
    assert "| dynamic | 4 | 1.000 | [0.510, 1.000] | 100.0% | yes |" in single
    assert "| evict@256 | 4 | 0.250 | [0.046, 0.699] | 14.0% |  |" in single
    assert "| hfkv@256 | 3 | 0.833 | " in single and " | 13.0% | yes |" in single
    assert single.index("| dynamic |") < single.index("| evict@256 |") < single.index("| hfkv@256 |")
    assert "1 example(s) left out: the full cache (`dynamic`) has no row for them." in single
    assert "left out" not in sec.split("### niah_multikey_2")[1].split("###")[0]
    avg = sec.split("### Average over tasks")[1].split("###")[0]
    assert "Tasks (dynamic's score): niah_multikey_2 (0.500), niah_single_1 (1.000)." in avg
    assert "Left out (dynamic < 0.3): ruler_vt (0.200)." in avg
    # means over the two solved tasks: dynamic (0.5 + 1) / 2, evict (0 + 1/4) / 2, hfkv (0.5 + 5/6) / 2
    assert "| dynamic | 2 | 0.750 | 100.0% | yes |" in avg
    assert "| evict@256 | 2 | 0.125 | 14.0% |  |" in avg
    assert "| hfkv@256 | 2 | 0.667 | 13.0% | yes |" in avg
    best = sec.split("### Best score per memory level")[1]
    assert "Full cache (`dynamic`): 0.750 on the same tasks' average." in best
    assert "| memory | dynamic | evict | hfkv |" in best
    assert "| ≤ 7.5% | — | — | — |" in best
    assert "| ≤ 15% | — | 0.125 (@256) | 0.667 (@256) |" in best
    assert "| ≤ 30% | — | 0.125 (@256) | 0.667 (@256) |" in best
    # the same from the rows directly, and deterministic
    rows = [json.loads(line) for line in (ruler_root / "eval" / "results" / "ruler_x.jsonl").read_text().splitlines()]
    assert mt.ruler_section(rows, ["eval/results/ruler_x.jsonl"]) == mt.ruler_section(
        list(rows), ["eval/results/ruler_x.jsonl"]
    )
    assert "\n".join(mt.ruler_section(rows, ["eval/results/ruler_x.jsonl"])) in text


def test_ruler_duplicates_keep_the_last_row():
    rows = [_ruler("niah_single_1", "dynamic", 0, s, 1.0) for s in (1.0, 0.0, 0.5)]
    sec = "\n".join(mt.ruler_section(rows))
    assert "| dynamic | 1 | 0.500 | " in sec
    assert "3 rows" not in sec and "1 rows took" in sec


def test_ruler_section_without_a_file(root):
    text, _ = mt.render(root, plots=False)
    sec = text.split("## RULER (lm-eval's offline tasks)\n\n")[1].split("\n\n")[0]
    assert sec == "No rows yet in `eval/results/ruler_*.jsonl` (run `eval/sweep_ruler.py`)."


def test_ruler_no_solved_task_and_best_cell_labels():
    rows = [
        _ruler("ruler_cwe", "dynamic", 0, 0.1, 1.0),
        _ruler("ruler_cwe", "quanto-int2", 0, 0.1, 0.14),
        _ruler("ruler_fwe", "evict@512:window=16", 0, 1.0, 0.1, "evict", 512),  # no dynamic rows
    ]
    sec = "\n".join(mt.ruler_section(rows))
    assert (
        "No task the full cache (`dynamic`) solves (score ≥ 0.3). Left out (dynamic < 0.3): ruler_cwe (0.100)." in sec
    )
    assert "Left out (no dynamic rows): ruler_fwe." in sec
    assert "### Best score per memory level" not in sec
    assert mt.ruler_cell({"method": "evict@512:window=16", "preset": "evict", "budget": 512, "score": 1.0}) == (
        "1.000 (@512:window=16)"
    )
    assert mt.ruler_cell({"method": "quanto-int2", "preset": "quanto-int2", "budget": None, "score": 0.1}) == "0.100"
    assert mt.ruler_cell({"method": "hfkv", "preset": "hfkv", "budget": 256, "score": 0.5}) == "0.500 (@256)"


def _agnostic(task, method, doc, score, mem, scores="reconstruction", length=4096):
    budget = int(method.split("@")[1]) if "@" in method else None
    return {"model": "m", "dtype": "bf16", "task": task, "length": length, "doc_id": doc, "method": method,
            "preset": method.split("@")[0], "budget": budget, "context_scores": scores, "score": score,
            "memory_ratio": mem}  # fmt: skip


def test_compress_once_targets_judge_the_default_scores_over_the_solved_tasks():
    rows = []
    for task, ok in (("a", (1.0, 1.0)), ("b", (1.0, 0.5)), ("c", (0.1, 0.1))):
        for doc in (0, 1):
            rows.append(_agnostic(task, "dynamic", doc, 1.0 if task != "c" else 0.1, 1.0, "observation"))
            rows.append(_agnostic(task, "hfkv@128", doc, ok[doc], 0.05))  # a: 1.0, b: 0.75 -> 87.5% of full
            rows.append(_agnostic(task, "hfkv@128", doc, 1.0, 0.05, "key_norm"))  # not the default scores
            rows.append(_agnostic(task, "hfkv@256", doc, 1.0, 0.15))  # 100% at 15%
            rows.append(_agnostic(task, "evict@256", doc, 0.5, 0.08, "observation"))  # 50% at 8%
            rows.append(_agnostic(task, "evict@128", doc, 0.95, 0.04))  # the default scores, not hfkv: 95% at 4%
        if task == "a":  # ran on one solved task only: not a candidate
            rows += [_agnostic(task, "streaming@64", d, 1.0, 0.02, "observation") for d in (0, 1)]
    rows += [_agnostic("d", "dynamic", d, 1.0, 1.0, "observation") for d in (0, 1)]  # solved, nothing else run
    aware = [{**_agnostic("a", "hfkv@128", d, 1.0, 0.05), "context_scores": None} for d in (0, 1)]
    text = "\n".join(mt.compress_once_section([], rows, aware))
    (line,) = [x for x in text.splitlines() if x.startswith("| 4096 ")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:4] == ["4096", "`a`, `b`", "`d`", "1.000"]
    assert cells[4:] == [
        "hfkv@128 reconstruction: 87.5% at 5.0%",
        "evict@128 reconstruction: 95.0% at 4.0%",
        "hfkv@256 reconstruction: 100.0% at 15.0%",
        "evict@128 reconstruction: 95.0% at 4.0%",
    ]
    assert "| hfkv@128 | question_aware | 2 | 1.000 |" in text  # the question-aware rows beside, for task a only
    assert text.count("| question_aware |") == 1


def test_compress_once_cost_table_gives_each_source_against_prefill_and_no_speed_from_a_busy_run():
    quiet = {"max_load": 0.5, "load_before": 0.2, "load_after": 0.3, "busy": False, "quiet_after": True}
    run = {"length": 4096, "rounds": 3, "ms_median": {"prefill": 10_000.0, "compress:reconstruction": 35_000.0},
           "ms_mean": {"prefill": 10_500.0, "compress:reconstruction": 36_000.0},
           "x_prefill": {"prefill": 1.0, "compress:reconstruction": 3.5}}  # fmt: skip
    res = {"model": "smollm2", "dtype": "fp32", "threads": 2, "budget": 256, "quiet": quiet, "runs": [run]}
    text = "\n".join(mt.compress_once_cost_section([("compress_once_cost_m.json", res)]))
    assert "| 4096 | compress:reconstruction | 35.0 | 36.0 | 3.50x |" in text
    assert "| 4096 | prefill | 10.0 | 10.5 | 1.00x |" in text
    busy = {**res, "quiet": {**quiet, "busy": True}}
    text = "\n".join(mt.compress_once_cost_section([("compress_once_cost_m.json", busy)]))
    assert "busy" in text and "3.50x" not in text


def test_wilson_interval():
    from hfkv.evaluation.results import wilson_interval

    assert mt.wilson is wilson_interval
    lo, hi = wilson_interval(3, 3)
    assert lo == pytest.approx(3 / (3 + 1.96**2)) and hi == 1.0
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(1.96**2 / (10 + 1.96**2))
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(2.5, 5)  # fractional successes: symmetric about 0.5
    assert lo == pytest.approx(1 - hi)


def test_calibration_block_compares_each_base_point_with_the_best_trial_at_or_below_its_memory():
    def trial(number, kl, mem, base=False, state="COMPLETE"):
        t = {"number": number, "state": state, "params": {"budget": 10 * number + 10},
             "metrics": {"kl": kl, "memory_ratio": mem}}  # fmt: skip
        return t | ({"base_point": "hfkv"} if base else {})

    summary = {
        "study": "s", "spec": {"space": {"granularity": "head"}}, "counts": {"complete": 5, "pruned": 1},
        "verdict": {"message": "no calibrated config beats the base"},
        "trials": [trial(0, 0.30, 0.2, base=True), trial(1, 0.01, 0.5, base=True), trial(2, 0.20, 0.19),
                   trial(3, 0.02, 0.45), trial(4, 0.001, 0.6), trial(5, 0.0, 0.1, state="PRUNED")],
    }  # fmt: skip
    rows = mt._base_vs_best(summary)
    assert [r[1] for r in rows] == ["10", "20"]
    assert rows[0][4].startswith("trial 2: 0.2000") and rows[0][5] == "trial"  # 0.20 at 0.19 beats 0.30 at 0.2
    assert rows[1][4].startswith("trial 3: 0.0200") and rows[1][5] == "base"  # trial 4 uses more memory
    full = {"config": "full", "kind": "reference", "kl": 0.0, "top1": 1.0, "memory_ratio": 1.0}
    level = {"level": 0.15, "rows": [], "missing": {"hfkv": {"message": "none"}}}
    hold = {"holdout": {"n": 3}, "rows": [full], "levels": [level]}
    block = mt.calibration_block(hold, [summary])
    assert "At 15% of DynamicCache's memory" in block and "- `hfkv`: none" in block
    assert "no calibrated config beats the base" in block
    assert mt.calibration_block(None, []).startswith("_No committed")


def test_calibration_block_labels_the_selected_config_by_the_studys_verdict():
    """The committed holdout.json calls the selected config ``calibrated`` though its study's verdict is ``base``."""
    full = {"config": "full", "kind": "reference", "kl": 0.0, "top1": 1.0, "memory_ratio": 1.0}
    sel = {"config": "study", "kind": "calibrated", "budget": 85, "kl": 0.01, "top1": 0.98, "memory_ratio": 0.28}
    preset = {"config": "hfkv", "kind": "preset", "budget": 85, "kl": 0.01, "top1": 0.98, "memory_ratio": 0.28}
    hold = {"holdout": {"n": 3}, "rows": [full, sel], "levels": [{"level": 0.3, "rows": [full, sel, preset]}]}

    def kinds(block: str) -> list[str]:
        return [line.split(" | ")[1] for line in block.splitlines() if line.startswith("| `study`")]

    assert kinds(mt.calibration_block(hold, [], verdict="base")) == ["base (selected)"] * 2
    assert kinds(mt.calibration_block(hold, [], verdict="calibrated")) == ["calibrated"] * 2
    assert "| `hfkv` | preset |" in mt.calibration_block(hold, [], verdict="base")


def test_committed_calibration_table_follows_the_long_studys_verdict():
    summary = json.loads((REPO / mt.CALIB_LONG / "summary.json").read_text(encoding="utf-8"))
    doc = (REPO / mt.CALIB_DOC).read_text(encoding="utf-8")
    block = doc[doc.index(mt.CALIB_START) : doc.index(mt.CALIB_END)]
    label = {"base": "base (selected)", "calibrated": "calibrated"}[summary["verdict"]["verdict"]]
    selected = [line for line in block.splitlines() if line.startswith(f"| `{summary['study']}` |")]
    assert selected and all(line.split(" | ")[1] == label for line in selected)


def _demo_run(**info) -> dict:
    run = {"date": "2026-01-01", "hfkv": "0.1.0", "torch": "2", "wall_s": 60.0, "cpu_count": 2, "machine": "x86_64",
           "threads": 2, "dtype": "float32", "load_average_before": 0.1, "load_average_after": 1.0}  # fmt: skip
    row = {"task": "kv_recall", "cache": "DynamicCache", "n": 4, "accuracy": 1.0, "compression": 1.0, "kv_kib": 9.0,
           "decode_tok_s": 100.0}  # fmt: skip
    return {"run": run | info, "rows": [row]}


def test_demo_table_marks_the_speed_column_of_a_run_that_was_not_quiet():
    note = "the load reached 3.00 during the run, 1.00 above what its 2 torch thread(s) explain: another process ran"
    busy = mt.demo_table(_demo_run(speed_comparable=False, speed_note=note))
    assert "decode tok/s*" in busy and f"not comparable between rows: {note}" in busy
    quiet = mt.demo_table(_demo_run(speed_comparable=True, speed_note=None))
    assert "decode tok/s*" not in quiet and "not comparable" not in quiet


def test_demo_table_judges_a_run_without_a_recorded_verdict_by_its_load_before():
    """eval/results/demo.json predates the verdict; its load before the run (0.53) was not below 0.5."""
    busy = mt.demo_table(_demo_run(load_average_before=0.53))
    assert "decode tok/s*" in busy and "load average was 0.53 before the run, not below 0.5" in busy
    assert "decode tok/s*" not in mt.demo_table(_demo_run(load_average_before=0.2))
    unknown = _demo_run()
    del unknown["run"]["load_average_before"]
    assert "decode tok/s*" not in mt.demo_table(unknown) and "load average — before" in mt.demo_table(unknown)


def test_every_bench_command_writes_into_the_committed_folder():
    """``hfkv bench`` writes under hfkv-out/bench unless told: the recipe must name eval/results/bench."""
    joined = mt.COMMANDS.replace("\\\n", " ")
    runs = [line for line in joined.splitlines() if "hfkv bench " in line and not line.lstrip().startswith("#")]
    assert runs and all(f"--out-dir {mt.BENCH_DIR}" in line for line in runs)


def _sections_file(quiet_after: bool = True) -> dict:
    quiet = {"max_load": 0.5, "cpu_count": 2, "threads": [2], "load_before": 0.4, "quiet_before": True,
             "load_after": 0.45 if quiet_after else 1.3, "quiet_after": quiet_after, "force_busy": False,
             "busy": not quiet_after}  # fmt: skip
    dyn = {"step": 20.0, "sdpa": 5.0, "dynamic_update": 3.0, "paged_attention_cpu": 0.0, "run_policy": 0.0,
           "held_tokens": 1000, "attention_macs": 512000}  # fmt: skip
    hf = {"step": 15.0, "sdpa": 0.0, "dynamic_update": 0.0, "paged_attention_cpu": 2.5, "run_policy": 1.25,
          "held_tokens": 750, "attention_macs": 384000}  # fmt: skip
    return {"model": "cpu-small", "dtype": "fp32", "context": 8192, "quiet": quiet, "git_commit": "abc1234",
            "ms_per_step": {"dynamic": dyn, "hfkv@1024": hf}, "model_floor_ms": 12.0,
            "free_attention_bound": 20 / 12, "fp32_peak_gmacs": 100.0,
            "attend_all": {"dynamic": {"mac_floor_ms": 0.5, "attend_all_bound": 20 / 12.5},
                           "hfkv@1024": {"mac_floor_ms": 0.25, "attend_all_bound": 20 / 12.25}}}  # fmt: skip


def test_step_sections_table_gives_each_caches_attention_policy_and_bounds():
    old = {"model": "cpu-small", "ms_per_step": {"hfkv@1024": {"step": 1.0}}}  # before the floor: left out
    sec = "\n".join(mt.step_sections_section([("a.json", _sections_file()), ("b.json", old)]))
    assert "`a.json`: cpu-small (fp32), 8,192 tokens" in sec and "`b.json`" not in sec
    assert "model floor 12.00 ms, free 1.67x; sgemm 100 GMAC/s" in sec and "code abc1234" in sec
    assert "| DynamicCache | 20.00 | 8.00 | 0.00 | 100% | 0.50 | 1.60x |" in sec
    assert "| `hfkv@1024` | 15.00 | 2.50 | 1.25 | 75% | 0.25 | 1.63x |" in sec


def test_step_sections_from_a_busy_machine_are_not_shown():
    sec = "\n".join(mt.step_sections_section([("a.json", _sections_file(quiet_after=False))]))
    assert "`a.json`" not in sec
    assert "No step-section file with a DynamicCache row and the multiply-add floor yet." in sec


def test_launch_binding_block_lists_each_kernel_and_puts_the_totals_beside_hfkvs_own():
    res = {
        "git_commit": "abc1234def", "triton": "3.6.0", "target": "cuda sm_90", "context": 4096, "batch": 8,
        "budget": 1024, "quiet": {"load_before": 0.3, "load_after": 0.4}, "busy": False, "command": "python x",
        "kernels": [
            {"phase": "policy_step", "kernel": "_plan_kernel", "arguments": 18, "launches": 1, "us_per_launch": 6.0},
            {"phase": "step", "kernel": "_partial_kernel", "arguments": 48, "launches": 7, "us_per_launch": 22.0},
        ],
        "us_per_layer_step": 35.5, "launches_per_layer_step": 3.0, "us_per_policy_run": 101.0,
        "launches_per_policy_run": 13,
    }  # fmt: skip
    host = {"host_us_per_layer": 19.2, "policy_run": {"host_us_per_layer": 416.4}}
    block = mt.launch_binding_block(res, host)
    assert "| policy run's step | `_plan_kernel` | 18 | 1 | 6.0 |" in block
    assert "| step | `_partial_kernel` | 48 | 7 | 22.0 |" in block
    assert "**35.5 us** of binding for its 3 launches, beside 19 us" in block
    assert "**101.0 us** for its 13 Triton launches, beside 416 us" in block
    assert "code abc1234" in block and "BUSY" not in block
    assert "BUSY" in mt.launch_binding_block(res | {"busy": True}, host)
    assert "no `eval/results/launch_binding_triton36.json` yet" in mt.launch_binding_block(None, host)
    assert "bound sites" not in block  # a file from before the bound sites
    bound = {
        "kernels": [{"kernel": "_partial_kernel", "arguments": 25, "same_objects": 20, "launches": 7,
                     "us_per_launch": 4.33}],
        "us_per_layer_step": 9.34,
    }  # fmt: skip
    block = mt.launch_binding_block(res | {"bound": bound}, host)
    assert "| `_partial_kernel` | 25 | 20 | 7 | 4.3 |" in block
    assert "**9.3 us** through the bound sites against 35.5 us of Triton's binding" in block
    assert "with hfkv's own 19 us, **29 us** of host" in block


def test_lossless_block_reads_the_committed_run():
    """docs/generate.md's "A budget that covers the sequence" table: one row per case of eval/lossless_budget.py,
    the share of exact tokens and the bytes computed from the recorded counts, and a missing file named with the
    command that makes it."""
    res = json.loads((REPO / mt.LOSSLESS).read_text(encoding="utf-8"))
    block = mt.lossless_block(res)
    rows = [line for line in block.splitlines() if line.startswith("| fp32") or line.startswith("| bf16")]
    assert len(rows) == len(res["rows"])
    for r, line in zip(res["rows"], rows, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[3] == ("yes" if r["identical"] else "no")
        assert cells[4] == ("—" if r["first_difference"] is None else str(r["first_difference"]))
        exact = (r["tokens"]["window"] + r["tokens"]["original"]) / sum(r["tokens"].values())
        assert cells[6] == f"{exact:.0%}" and cells[7] == f"{r['kv_bytes'] / r['dynamic_cache_bytes']:.3f}x"
    assert "python -m eval.lossless_budget --out eval/results/lossless_budget.json" in mt.lossless_block(None)
