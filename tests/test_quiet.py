"""Timing only on a quiet machine (hfkv.evaluation.quiet): the load-average check before and after a run,
thread-count lists, how ``hfkv bench`` and ``eval/cpu_cache_figures.py`` refuse or mark a busy run, and how
eval/make_tables.py renders busy and unrecorded results. The load average is faked; nothing is timed for real."""

from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path

import pytest

from eval import make_tables as mt
from hfkv.evaluation import bench, quiet

REPO = Path(__file__).resolve().parents[1]


class Loads:
    """A fake 1-minute load average: ``values`` in turn (the last repeats); sleeps are counted, not slept."""

    def __init__(self, monkeypatch, *values: float):
        self.values, self.calls, self.slept = list(values), 0, []
        monkeypatch.setattr(quiet.os, "getloadavg", self.getloadavg)
        monkeypatch.setattr(quiet, "_sleep", self.slept.append)

    def getloadavg(self):
        value = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return (value, value, value)


# ------------------------------------------------------------------------------------------ threads
def test_thread_lists():
    assert quiet.parse_threads("1,all", cpu_count=8) == [1, 8]
    assert quiet.parse_threads("1, all", cpu_count=1) == [1]  # one core: 'all' is 1 thread, timed once
    assert quiet.parse_threads("4,2,4", cpu_count=8) == [4, 2]
    assert quiet.parse_threads([1, 2]) == [1, 2] and quiet.parse_threads("ALL", cpu_count=3) == [3]
    for bad, msg in (("0", "'0' must be"), ("1,x", "'x' is not"), ("", "empty"), ("-2", "'-2' must be")):
        with pytest.raises(ValueError, match=msg):
            quiet.parse_threads(bad)


# ------------------------------------------------------------------------------------------ the check
def test_start_refuses_a_busy_machine_unless_forced(monkeypatch):
    Loads(monkeypatch, 0.9)
    with pytest.raises(quiet.BusyMachine, match=r"busy machine: 1-minute load average 0.90, not below --max-load 0.5"):
        quiet.start([1, 2])
    rec = quiet.start([1, 2], force_busy=True)
    assert rec["busy"] is True and rec["quiet_before"] is False and rec["load_before"] == 0.9
    assert rec["force_busy"] is True and rec["threads"] == [1, 2] and rec["cpu_count"] >= 1
    assert set(rec) == set(quiet.RECORD_FIELDS)
    assert quiet.start([1], max_load=1.0)["busy"] is False  # below a higher limit


def test_start_without_a_load_average_refuses(monkeypatch):
    monkeypatch.setattr(quiet, "load_average", lambda: None)
    with pytest.raises(quiet.BusyMachine, match="no load average on this platform"):
        quiet.start([1])
    assert quiet.verdict(quiet.start([1], force_busy=True)) == "load not recorded"


def test_wait_quiet_polls_until_the_load_falls(monkeypatch):
    loads = Loads(monkeypatch, 2.0, 1.0, 0.6, 0.4)
    rec = quiet.start([1], wait_s=60)
    assert rec["quiet_before"] and rec["load_before"] == 0.4 and rec["waited_s"] == 15.0
    assert loads.slept == [5.0, 5.0, 5.0]
    loads = Loads(monkeypatch, 2.0)
    with pytest.raises(quiet.BusyMachine, match=r"\(waited 12 s\)"):
        quiet.start([1], wait_s=12)
    assert loads.slept == [5.0, 5.0, 2.0]  # gives up after --wait-quiet seconds


def test_finish_waits_for_the_runs_own_load_to_decay(monkeypatch):
    # the run ends at load 1.0 (its own thread); an idle machine decays below 0.5 within 60 s * ln 2
    loads = Loads(monkeypatch, 0.1, 1.0, 0.8, 0.6, 0.45)
    rec = quiet.finish(quiet.start([1]))
    assert rec["load_at_end"] == 1.0 and rec["load_after"] == 0.45 and rec["settle_s"] == 15.0
    assert rec["quiet_after"] and rec["busy"] is False and quiet.verdict(rec) is None
    assert quiet.describe(rec) == "load average 0.10 before / 0.45 after, max 0.5"
    # something else keeps the load up: after the decay time the result is marked busy
    loads = Loads(monkeypatch, 0.1, 1.0, 0.9)
    rec = quiet.finish(quiet.start([1]))
    limit = 60 * math.log(1.0 / 0.5) + quiet.SETTLE_MARGIN_S
    assert sum(loads.slept) == pytest.approx(limit) and rec["settle_s"] == round(limit, 1)
    assert rec["quiet_before"] and not rec["quiet_after"] and rec["busy"] is True
    assert quiet.verdict(rec) == "busy machine"


def test_finish_of_a_busy_run_does_not_wait(monkeypatch):
    loads = Loads(monkeypatch, 3.0)
    rec = quiet.finish(quiet.start([1], force_busy=True))
    assert loads.slept == [] and rec["busy"] and rec["load_after"] == 3.0


def test_verdicts():
    assert quiet.verdict(None) == quiet.verdict({}) == "load not recorded"
    started = {"load_before": 0.1, "max_load": 0.5, "busy": False, "load_after": None}
    assert "interrupted" in quiet.verdict(started)
    assert quiet.describe(started) == "load average 0.10 before, none after, max 0.5"
    assert quiet.verdict({**started, "load_after": 0.2}) is None


# ------------------------------------------------------------------------------------------ hfkv bench
TOY = [
    *("--random-like", "cpu-small", "--random-layers", "1", "--dtype", "fp32", "--methods", "dynamic,evict@48"),
    *("--contexts", "64", "--decode-steps", "2", "--warmup", "1", "--no-progress", "--no-plot", "--name", "t"),
    *("--threads", "1"),
]


def test_bench_refuses_a_busy_machine_before_loading(monkeypatch, tmp_path, capsys):
    Loads(monkeypatch, 1.5)
    monkeypatch.setattr(bench, "load_bench_model", lambda *a: pytest.fail("a model was built"))
    assert bench.main([*TOY, "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hfkv bench: error: busy machine: 1-minute load average 1.50")
    assert "--force-busy" in err[0] and "--wait-quiet" in err[0]
    assert not list(tmp_path.iterdir())


def test_bench_force_busy_marks_the_file(monkeypatch, tmp_path):
    Loads(monkeypatch, 1.5)
    assert bench.main([*TOY, "--out-dir", str(tmp_path), "--force-busy"]) == 0
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["busy"] is True
    q = result["groups"][0]["quiet"]
    assert q["busy"] and q["force_busy"] and q["load_before"] == q["load_after"] == 1.5 and q["threads"] == [1]
    assert result["quiet"] == q and result["groups"][0]["threads"] == 1
    assert "False" in (tmp_path / "t.csv").read_text().splitlines()[1].split(",")  # the CSV's quiet column


def test_bench_load_after_the_run_marks_it_busy(monkeypatch, tmp_path):
    Loads(monkeypatch, 0.1, 1.0)  # quiet before; after the run the load stays at 1.0
    assert bench.main([*TOY, "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "t.json").read_text())
    q = result["groups"][0]["quiet"]
    assert q["quiet_before"] and not q["quiet_after"] and q["busy"] and result["busy"]
    assert q["load_before"] == 0.1 and q["load_after"] == 1.0 and q["settle_s"] > 0


def test_cpu_cache_figures_refuses_a_busy_machine(monkeypatch, tmp_path, capsys):
    Loads(monkeypatch, 2.0)
    monkeypatch.setattr(sys, "argv", ["cpu_cache_figures.py", "--out", str(tmp_path / "f.json")])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(REPO / "eval" / "cpu_cache_figures.py"), run_name="__main__")
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cpu_cache_figures.py: error: busy machine:")
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------ make_tables
def _record(before: float, after: float, **extra) -> dict:
    busy = not (before < 0.5 and after < 0.5)
    return {"max_load": 0.5, "cpu_count": 2, "threads": [1, 2], "load_before": before, "load_after": after} | {
        "quiet_before": before < 0.5,
        "quiet_after": after < 0.5,
        "busy": busy,
        **extra,
    }


def _bench_rows(speedup: float) -> list[dict]:
    rows = []
    for method, x in (("dynamic", 1.0), ("evict@48", speedup)):
        rows.append(
            {"method": method, "kind": "tristate", "preset": method.split("@")[0], "budget": 48, "context": 64}
            | {"batch": 1, "kv_bytes": 2**20, "memory_ratio": 0.5, "decode_ms_median": 10 / x}
            | {"decode_speedup_median": x, "decode_speedup_mean": x * 0.9, "prefill_speedup": 1.0}
        )
    return rows


def test_tables_print_speed_only_from_quiet_results():
    groups = [
        {"threads": 1, "context": 64, "batch": 1, "rows": _bench_rows(1.77), "quiet": _record(0.1, 0.3)},
        {"threads": 2, "context": 64, "batch": 1, "rows": _bench_rows(2.66), "quiet": _record(0.9, 1.2)},
    ]
    res = {"name": "t", "model": {"description": "toy"}, "dtype": "fp32", "device": "cpu", "groups": groups}
    legacy = {**res, "name": "u", "args": {"threads": 1}, "groups": [{**groups[0], "threads": None, "quiet": None}]}
    text = "\n".join(mt.bench_section([res, legacy], plots=None))
    quiet_part = text.split("1 torch thread (of 2 CPUs); quiet machine")[1].split("torch threads (of 2 CPUs)")[0]
    assert "load average 0.10 before / 0.30 after, max 0.5" in quiet_part
    assert "| 64 | 1 | evict@48 | 1.00 | 50.0% | 5.65 | 1.77x | 1.59x | 1.00x |" in quiet_part
    busy = text.split("2 torch threads (of 2 CPUs); ")[1].split("###")[0]
    assert busy.startswith("busy machine: not a result (load average 0.90 before / 1.20 after, max 0.5); memory only")
    assert "| 64 | 1 | evict@48 | 1.00 | 50.0% |\n" in busy and "2.66x" not in text
    old = text.split("### u: toy")[1]
    assert "1 torch thread; load not recorded: not a result" in old and "1.77x" not in old


def test_cpu_figures_of_busy_and_unrecorded_files_show_memory_only():
    entry = {"context": 8192, "dynamic_ms_median": 56.0, "dynamic_ms_mean": 57.0}
    entry["hfkv"] = {"ms_median": 28.7, "speedup_median": 1.95, "speedup_mean": 1.38, "memory_fraction": 0.126}
    base = {"machine": "x86_64, 2 CPUs", "torch": "2", "args": {"threads": "1"}}
    legacy = mt.cpu_figures_section({**base, "decode_long": entry})  # a file from before loads were recorded
    text = "\n".join(legacy)
    assert "Timing: load not recorded: not a result" in text and "1.95x" not in text
    assert "Decode at 8,192 tokens, 1 torch thread:" in text and "| `hfkv` | 12.6% |" in text
    timings = [{"threads": 1, "decode_long": entry}, {"threads": 2, "decode_long": entry}]
    busy = "\n".join(mt.cpu_figures_section({**base, "quiet": _record(0.2, 0.8), "busy": True, "timings": timings}))
    assert "Timing: busy machine: not a result (load average 0.20 before / 0.80 after, max 0.5)" in busy
    assert "1.95x" not in busy and "Decode at 8,192 tokens, 2 torch threads (of 2 CPUs):" in busy
    ok = "\n".join(mt.cpu_figures_section({**base, "quiet": _record(0.2, 0.3), "busy": False, "timings": timings}))
    assert "Timing: quiet machine, load average 0.20 before / 0.30 after, max 0.5." in ok
    assert ok.count("| `hfkv` | 12.6% | 28.70 | 1.95x | 1.38x |") == 2
