"""The sweep scripts: rows measured as ``hfkv demo`` measures them, resumed instead of re-run, and fidelity
documents generated to exact lengths; all on the shipped testbed model with a few examples."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from hfkv.evaluation.results import read_rows
from hfkv.testbed import load_testbed
from hfkv.testbed.protocol import evaluate
from hfkv.testbed.tasks import load_test_set

REPO = Path(__file__).resolve().parents[1]


def _script(name: str, argv: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [name, *argv])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(REPO / "eval" / name), run_name="__main__")
    assert exc.value.code == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def testbed():
    return load_testbed()


def test_sweep_testbed_rows_match_hfkv_demo_and_resume(tmp_path, monkeypatch, capsys, testbed):
    out = tmp_path / "sweep.jsonl"
    argv = ["--methods", "dynamic,evict", "--budgets", "80", "--tasks", "kv_recall", "--dtypes", "fp32"]
    argv += ["--limit", "3", "--batch-size", "1", "--out", str(out), "--no-progress"]
    log = _script("sweep_testbed.py", argv, monkeypatch, capsys)
    assert "2 rows to run" in log
    rows = {r["method"]: r for r in read_rows(out)}
    assert sorted(rows) == ["dynamic", "evict@80"]
    model, tok = testbed
    data = load_test_set("kv_recall")[:3]
    for method, preset, budget in (("dynamic", None, None), ("evict@80", "evict", 80)):
        r, ref = rows[method], evaluate(model, tok, "kv_recall", data, preset, budget, batch_size=1)
        assert r["n"] == 3 and r["accuracy"] == ref["accuracy"]
        assert r["kv_bytes"] / 1024 == pytest.approx(ref["kv_kib"])
        assert r["compression"] == pytest.approx(ref["compression"])
        assert r["memory_ratio"] == pytest.approx(r["kv_bytes"] / r["dense_bytes"])
        assert r["dtype"] == "fp32" and r["task"] == "kv_recall" and r["hfkv_version"] and r["date"]
    assert rows["dynamic"]["kv_bytes"] == rows["dynamic"]["dense_bytes"]
    assert rows["evict@80"]["preset"] == "evict" and rows["evict@80"]["budget"] == 80
    # resumed: nothing re-run; a new budget runs only the new row
    assert "0 rows to run" in _script("sweep_testbed.py", argv, monkeypatch, capsys)
    argv[argv.index("80")] = "80,96"
    assert "1 rows to run" in _script("sweep_testbed.py", argv, monkeypatch, capsys)
    assert sorted(r["method"] for r in read_rows(out)) == ["dynamic", "evict@80", "evict@96"]


def test_generated_documents_have_exact_lengths_and_no_special_tokens(tmp_path, testbed):
    from hfkv.evaluation.texts import ensure_documents, generate_documents

    model, tok = testbed
    docs = generate_documents(model, tok, 2, prompt_tokens=160, continuation_tokens=8)
    special = set(tok.all_special_ids)
    for i, d in enumerate(docs):
        assert d["id"] == i and d["n_tokens"] == len(d["ids"]) == 168 and d["prompt_len"] == 160
        assert not special & set(d["ids"][d["chat_prefix_len"] :])
    path = tmp_path / "texts.jsonl"
    first = ensure_documents(model, tok, path, 1, 160, 8)
    again = ensure_documents(model, tok, path, 2, 160, 8)  # appends document 1, keeps document 0
    assert again[0] == first[0] and [d["id"] for d in again] == [0, 1]
    with pytest.raises(ValueError, match="not 160 \\+ 16"):
        ensure_documents(model, tok, path, 2, 160, 16)


def test_sweep_fidelity_reference_is_exact_and_rows_resume(tmp_path, monkeypatch, capsys, testbed):
    from hfkv.evaluation.texts import ensure_documents

    model, tok = testbed
    texts = tmp_path / "texts.jsonl"
    ensure_documents(model, tok, texts, 1, 200, 12)
    out = tmp_path / "fid.jsonl"
    argv = ["--model", "testbed", "--texts", str(texts), "--docs", "1", "--methods", "dynamic,evict@64:window=8"]
    argv += ["--budgets", "", "--out", str(out)]
    assert "2 rows to run" in _script("sweep_fidelity.py", argv, monkeypatch, capsys)
    rows = {r["method"]: r for r in read_rows(out)}
    assert rows["dynamic"]["kl"] == pytest.approx(0.0, abs=1e-6) and rows["dynamic"]["top1"] == 1.0
    assert rows["dynamic"]["memory_ratio"] == 1.0 and rows["dynamic"]["positions"] == 12
    ev = rows["evict@64:window=8"]
    assert ev["memory_ratio"] < 0.5 and ev["kl"] > 0 and 0 <= ev["top1"] <= 1
    assert ev["doc"] == 0 and ev["texts"] == str(texts) and json.loads(json.dumps(ev)) == ev
    assert "0 rows to run" in _script("sweep_fidelity.py", argv, monkeypatch, capsys)


def test_a_row_whose_config_changed_is_rerun_and_replaced(tmp_path, monkeypatch, capsys):
    """Resuming keys rows by method label, but a label whose config now differs (a preset's new defaults,
    an edited YAML file) is re-run and its row replaced, never silently kept."""
    import hfkv

    cfg = tmp_path / "mine.yaml"
    hfkv.TriStateConfig.from_preset("evict", budget=80).to_yaml(str(cfg))
    out = tmp_path / "sweep.jsonl"
    argv = ["--methods", str(cfg), "--budgets", "", "--tasks", "kv_recall", "--dtypes", "fp32", "--limit", "2"]
    argv += ["--out", str(out), "--no-progress"]
    assert "1 rows to run" in _script("sweep_testbed.py", argv, monkeypatch, capsys)
    assert "0 rows to run" in _script("sweep_testbed.py", argv, monkeypatch, capsys)
    cfg.write_text(cfg.read_text().replace("window: 32", "window: 16"))
    assert "1 rows to run" in _script("sweep_testbed.py", argv, monkeypatch, capsys)
    (row,) = read_rows(out)
    assert row["method"] == str(cfg) and row["config"]["window"] == 16


@pytest.mark.slow
def test_sweep_ruler_rows_and_resume(tmp_path, monkeypatch, capsys):
    """eval/sweep_ruler.py on the testbed at toy length: one row per (example, method) with RULER's score and
    the bytes held; a second run finds every row done."""
    pytest.importorskip("wonderwords")
    from hfkv.evaluation.results import ResultFile

    out = tmp_path / "ruler.jsonl"
    argv = ["--model", "testbed", "--dtype", "fp32", "--tasks", "niah_single_1", "--lengths", "512", "--limit", "2"]
    argv += ["--methods", "dynamic,evict@64:window=16", "--out", str(out)]
    _script("sweep_ruler.py", argv, monkeypatch, capsys)
    rows = read_rows(out)
    assert sorted((r["doc_id"], r["method"]) for r in rows) == [
        (d, m) for d in (0, 1) for m in ("dynamic", "evict@64:window=16")
    ]
    for r in rows:
        assert r["score"] in (0.0, 1.0) and r["length"] == 512 and r["refs"]
        assert r["memory_ratio"] == pytest.approx(r["kv_bytes"] / r["dense_bytes"])
        assert (r["memory_ratio"] == 1.0) == (r["method"] == "dynamic")
    resumed = ResultFile(out, ("model", "dtype", "task", "length", "doc_id", "method"), ("config", "options"))
    assert all(resumed.has(r) for r in rows)


def test_result_file_append_survives_a_cut_last_line(tmp_path):
    from hfkv.evaluation.results import ResultFile

    path = tmp_path / "rows.jsonl"
    f = ResultFile(path, ("k",))
    f.append({"k": 1, "v": "a"})
    f.append({"k": 2, "v": "b"})
    f.append({"k": 1, "v": "c"})  # an existing key is replaced, not duplicated
    assert [(r["k"], r["v"]) for r in read_rows(path)] == [(2, "b"), (1, "c")]
    path.write_text(path.read_text() + '{"k": 3, "v"')  # a kill in the middle of an append
    g = ResultFile(path, ("k",))
    assert not g.has({"k": 3}) and g.has({"k": 2})
    path.write_text('{"k": 3, "v"\n{"k": 4}\n')  # a broken line that is not the last one is an error
    with pytest.raises(ValueError, match="rows.jsonl:1"):
        read_rows(path)


def test_human_documents_are_cut_from_this_pythons_sources(testbed):
    import hashlib

    from hfkv.evaluation.human_texts import SOURCES, human_documents, source_text

    _, tok = testbed
    docs = human_documents(tok, 3, prompt_tokens=100, continuation_tokens=20)
    assert [d["id"] for d in docs] == [0, 1, 2] and len({d["source"] for d in docs}) == 3
    for d, (kind, name) in zip(docs, SOURCES, strict=False):
        text = source_text(kind, name)
        assert d["source"] == f"{kind}:{name}" and d["sha256"] == hashlib.sha256(text.encode()).hexdigest()
        assert d["n_tokens"] == len(d["ids"]) == 120 and d["prompt_len"] == 100
        assert d["ids"] == tok(text)["input_ids"][:120]  # the start of the human-written text, nothing else
    assert human_documents(tok, 3, 100, 20) == docs
    with pytest.raises(ValueError, match="human-written sources"):
        human_documents(tok, len(SOURCES) + 1)


def test_sweep_fidelity_on_human_written_documents(tmp_path, monkeypatch, capsys):
    out = tmp_path / "fid.jsonl"
    argv = ["--model", "testbed", "--texts", "human", "--docs", "2", "--methods", "dynamic", "--budgets", ""]
    argv += ["--prompt-tokens", "150", "--continuation-tokens", "6", "--out", str(out)]
    assert "2 rows to run" in _script("sweep_fidelity.py", argv, monkeypatch, capsys)
    rows = read_rows(out)
    assert [r["source"] for r in rows] == ["pydoc:compound", "module:argparse"]
    assert all(r["texts"] == "human" and r["kl"] == pytest.approx(0.0, abs=1e-6) for r in rows)
    assert "0 rows to run" in _script("sweep_fidelity.py", argv, monkeypatch, capsys)
