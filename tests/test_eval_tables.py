"""eval/make_tables.py: the committed eval/README.md and README.md's demo table are what the script makes from
the committed result files; Pareto marks, thresholds, missing rows and aggregation checked on hand-made rows."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_tables", REPO / "eval" / "make_tables.py")
mt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mt)


def test_committed_markdown_is_reproduced_byte_for_byte():
    readme, demo = mt.render(REPO, plots=False)
    assert (REPO / "eval" / "README.md").read_text(encoding="utf-8") == readme
    top = (REPO / "README.md").read_text(encoding="utf-8")
    assert mt.replace_block(top, demo) == top
    assert mt.main(["--check"]) == 0


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
    demo = top[start:end]
    assert "kv_recall  DynamicCache      100     1.000        1.00x      100.0         100.0" in demo
    assert "kv_recall  streaming@80        —         —            —          —             —" in demo
    assert "arith_cot  hfkv@80           100     0.500        2.00x       50.0         100.0" in demo
    assert mt.main(["--root", str(root), "--check"]) == 0
    (root / mt.TESTBED).write_text((root / mt.TESTBED).read_text().replace('"accuracy": 0.9,', '"accuracy": 0.8,'))
    assert mt.main(["--root", str(root), "--check"]) == 1


def test_missing_markers_are_an_error():
    with pytest.raises(ValueError, match="results:demo-table:start"):
        mt.replace_block("no markers here", "x")
