"""eval/kernel_bench.py on a CPU: the parts its GPU figures rest on.

The benchmark's bandwidth figures are bytes over time, so a wrong byte count is a wrong result
that no GPU run would reveal: the accounting is checked against storage built by the real
``PagedTiers`` and counted independently. Skipping by memory and the no-GPU exit are checked
because they decide what a sweep does before anything is measured.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from eval import kernel_bench as kb

REPO = Path(__file__).resolve().parents[1]

TOY = kb.AttnShape(heads=4, kv_heads=2, head_dim=32, dtype=torch.bfloat16)
LLAMA = kb.AttnShape.like("llama-3.1-8b")


def _independent_bytes(plan, st) -> dict[str, int]:
    """What the call must read, counted from the built tensors: live records found by their tags."""
    tiers, esz = st.tiers, TOY.esize
    got = {"live": [], "tails": 0, "records_kv": 0, "tags": 0, "held": 0, "tables": 0}
    for t, lay in enumerate(plan.layouts):
        rec, tags = tiers.read_slots(t)  # every slot the kernel walks: whole pages, tails included
        live = int((tags > 0).sum())
        got["live"].append(live)
        walked = rec.shape[0] * rec.shape[1] * rec.shape[2]
        got["tails"] += (walked - live) * (lay.key.nbytes + lay.value.nbytes + 4)
        got["records_kv"] += live * (lay.key.nbytes + lay.value.nbytes)
        got["tags"] += live * 4
        got["held"] += live * lay.nbytes
        got["tables"] += tiers.tables[t].numel() * 4
    got["query"] = st.query.numel() * esz
    got["window"] = 0 if st.window is None else (st.window[0].numel() + st.window[1].numel()) * esz
    got["window_pos"] = 0 if st.window is None else st.window[2].numel() * 8
    return got


@pytest.mark.parametrize("kind", kb.KINDS)
def test_bytes_accounting_equals_the_built_storage(kind):
    plan = kb.make_plan(kind, context=150, batch=2, shape=TOY)
    st = kb.build_storage(plan, "cpu")
    acct = kb.kernel_bytes(plan)
    got = _independent_bytes(plan, st)
    bh = plan.batch * TOY.kv_heads
    assert got["live"] == [bh * n for n in plan.tier_tokens]
    assert acct["records_held"] == got["held"]  # live records x layout.nbytes
    assert acct["read_records_kv"] == got["records_kv"]
    assert acct["read_records_tags"] == got["tags"]
    assert acct["read_page_tables"] == got["tables"]
    assert acct["read_query"] == got["query"]
    assert acct["read_window_kv"] == got["window"]
    assert acct["read_window_pos"] == got["window_pos"]
    assert acct["read_total"] == (
        got["query"] + got["window"] + got["window_pos"] + got["records_kv"] + got["tags"] + got["tables"]
    )
    assert acct["overhead_page_tails"] == got["tails"]  # empty slots of last pages: overhead, not need
    assert acct["traffic_total"] == acct["read_total"] + acct["overhead_total"] > acct["read_total"]
    # Every logical position is held exactly once per head (ring + tiers), so the kernel attends the context.
    metas = [st.tiers.read_meta(t) for t in range(2)]
    held = [pos[valid].view(2, 2, -1) for pos, _, valid in metas]  # whole pages: a head's tail slots are not valid
    if st.window is not None:
        held.append(st.window[2].to(torch.int32).expand(2, 2, -1))
    held = torch.cat(held, -1).sort(-1).values
    assert torch.equal(held, torch.arange(150, dtype=torch.int32).expand(2, 2, -1))


def test_quantized_storage_reads_fewer_bytes_than_sdpa():
    ctx, batch = 32768, 8
    dense = kb.sdpa_bytes(ctx, batch, LLAMA)["read_total"]
    assert dense == 2 * batch * 8 * ctx * 128 * 2 + batch * 32 * 128 * 2
    reads = {k: kb.kernel_bytes(kb.make_plan(k, ctx, batch, LLAMA))["read_total"] for k in kb.KINDS}
    # full: the same K/V plus the tags and page tables; K4V2 records are about a quarter of it.
    assert 1.0 < reads["full"] / dense < 1.02
    assert 3.5 < dense / reads["quant"] < 4.0
    assert reads["quant"] < reads["hfkv"] < reads["full"]


def test_cases_over_free_memory_are_skipped_with_the_reason():
    free = 6 << 30
    cases = kb.enumerate_cases(kb.KINDS, [4096, 131072], [1, 32], LLAMA, free)
    by = {(c.plan.kind, c.plan.context, c.plan.batch): c for c in cases}
    assert len(cases) == 12
    assert [c.plan.context for c in cases] == sorted(c.plan.context for c in cases)  # context-major run order
    for kind in kb.KINDS:
        assert by[(kind, 4096, 1)].skip is None
        big = by[(kind, 131072, 32)]
        assert big.need > free * kb.MEMORY_HEADROOM
        assert big.skip is not None and "GiB" in big.skip and "free" in big.skip
        assert by[(kind, 131072, 32)].sdpa_skip is not None  # 32 GiB of dense K/V
    assert by[("full", 4096, 1)].sdpa_skip is None
    # The full-precision pool needs about four times the quantized one.
    assert by[("full", 131072, 32)].need > 1.8 * by[("quant", 131072, 32)].need
    # With room for everything nothing is skipped.
    assert all(
        c.skip is None and c.sdpa_skip is None for c in kb.enumerate_cases(kb.KINDS, [131072], [32], LLAMA, 1 << 40)
    )


def test_without_cuda_main_exits_2_with_a_clear_message(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        kb.main(["--skip-e2e", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_device_slug_is_file_name_safe():
    assert kb.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert kb.device_slug("NVIDIA H200") == "nvidia-h200"
    assert kb.device_slug("  ") == "unknown-device"


def test_rows_targets_and_plot(tmp_path):
    copy_gbps = 3000.0
    rows = []
    for kind, frac in (("full", 0.9), ("quant", 0.7)):
        for ctx, batch in ((4096, 1), (32768, 8)):
            plan = kb.make_plan(kind, ctx, batch, LLAMA)
            acct = kb.kernel_bytes(plan)
            ms = acct["read_total"] / (frac * copy_gbps * 1e9) * 1e3
            timing = {"ms_median": ms, "ms_p20": ms, "ms_p80": ms, "ms_min": ms, "repeats": 3, "mode": "graph"}
            dense = kb.sdpa_bytes(ctx, batch, LLAMA)["read_total"]
            sdpa_ms = dense / (0.9 * copy_gbps * 1e9) * 1e3
            sdpa = {"layout": "gqa", "timing": dict(timing, ms_median=sdpa_ms), "read_bytes": dense, "write_bytes": 0}
            row = kb.kernel_row(plan, acct, {"timing": timing}, copy_gbps, sdpa)
            assert row["read_fraction"] == pytest.approx(frac)
            assert row["speedup_vs_sdpa"] == pytest.approx(sdpa_ms / ms)
            assert row["speedup_per_bytes_ratio"] == pytest.approx(frac / 0.9)
            rows.append(row)
    plan = kb.make_plan("hfkv", 131072, 32, LLAMA)
    skipped = kb.kernel_row(plan, kb.kernel_bytes(plan), {"skipped": "needs 99 GiB"}, copy_gbps)
    assert skipped["status"] == "skipped" and skipped["reason"] == "needs 99 GiB"
    rows.append(skipped)
    e2e = {"speedup": 5.0, "compression_ratio": 12.0, "context": 32768, "batch": 8}
    t = kb.summarize_targets(rows, e2e)
    assert t["kernel_bandwidth"]["full"] == {
        "cases": 1,
        "min": pytest.approx(0.9),
        "median": pytest.approx(0.9),
        "met": True,
    }
    assert t["kernel_bandwidth"]["quant"]["met"] is False  # only the 32k x 8 case counts, at 70%
    assert t["kernel_bandwidth"]["hfkv"]["cases"] == 0 and t["kernel_bandwidth"]["hfkv"]["met"] is None
    assert t["e2e"]["met"] is False  # 5x < 12x / 2
    result = {"device": "test", "copy_bandwidth": {"gbps": copy_gbps}, "kernel_rows": rows, "e2e": e2e}
    kb.plot(json.loads(json.dumps(result)), tmp_path / "k.png")
    assert (tmp_path / "k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU path runs under Triton's interpreter")
def test_kernel_case_times_on_cpu_under_the_interpreter():
    plan = kb.make_plan("hfkv", context=64, batch=1, shape=TOY)
    res = kb.bench_kernel_case(plan, "cpu", repeats=2, warmup=1, check=True)
    assert res["check"]["ok"], res["check"]
    assert res["timing"]["mode"] == "wall" and res["timing"]["repeats"] == 2
    row = kb.kernel_row(plan, kb.kernel_bytes(plan), res, copy_gbps=10.0)
    assert row["status"] == "ok" and row["read_gbps"] > 0


def test_main_writes_rows_skips_and_plot_with_the_gpu_parts_faked(monkeypatch, tmp_path, capsys):
    """The sweep's bookkeeping (case order, skips, SDPA pairing, merge with an earlier file, JSON + PNG),
    with the device calls replaced by fixed figures so it runs on a CPU."""

    class Props:
        total_memory, multi_processor_count = 80 << 30, 132

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU 80GB")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: Props())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (3 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    timing = {"ms_median": 2.0, "ms_p20": 1.9, "ms_p80": 2.1, "ms_min": 1.8, "repeats": 3, "mode": "graph"}
    monkeypatch.setattr(kb, "measure_copy_bandwidth", lambda: {"gbps": 3000.0, "bytes": 1})
    monkeypatch.setattr(kb, "bench_kernel_case", lambda plan, *a: {"timing": dict(timing)})
    monkeypatch.setattr(
        kb,
        "bench_sdpa",
        lambda c, b, shape, *a: {
            "layout": "gqa",
            "timing": dict(timing, ms_median=4.0),
            "read_bytes": 10,
            "write_bytes": 0,
        },
    )
    slug = tmp_path / "kernel_bench_fake-gpu-80gb.json"
    slug.write_text(json.dumps({"kernel_rows": [{"kind": "full", "context": 1024, "batch": 1, "status": "ok"}]}))
    argv = [
        "--skip-e2e",
        "--contexts",
        "4096,131072",
        "--batches",
        "1,8",
        "--kinds",
        "quant,hfkv",
        "--out",
        str(tmp_path),
    ]
    assert kb.main(argv) == 0
    result = json.loads(slug.read_text())
    rows = {(r["kind"], r["context"], r["batch"]): r for r in result["kernel_rows"]}
    assert ("full", 1024, 1) in rows  # an earlier run's row is kept
    assert len(rows) == 1 + 2 * 2 * 2
    cases = kb.enumerate_cases(["quant", "hfkv"], [4096, 131072], [1, 8], LLAMA, 3 << 30)
    assert any(c.skip for c in cases) and not all(c.skip for c in cases)
    assert any(c.sdpa_skip for c in cases) and not all(c.sdpa_skip for c in cases)
    for c in cases:
        row = rows[(c.plan.kind, c.plan.context, c.plan.batch)]
        assert row["status"] == ("skipped" if c.skip else "ok")
        if c.skip is None:
            assert row["read_fraction"] == pytest.approx(row["read_bytes"] / 2e-3 / 3000e9)
            assert ("skipped" in row["sdpa"]) == (c.sdpa_skip is not None)
            assert (row.get("speedup_vs_sdpa") == 2.0) == (c.sdpa_skip is None)
    assert result["device"] == "Fake GPU 80GB" and result["copy_bandwidth"]["gbps"] == 3000.0
    assert (tmp_path / "kernel_bench_fake-gpu-80gb.png").exists()
    assert "wrote" in capsys.readouterr().out


def test_kernel_variants_dry_run_times_every_launch_shape_with_the_default_result(tmp_path):
    """eval/kernel_variants.py (the launch-shape sweep a lent GPU runs) at toy sizes: every variant runs
    and gives the default launch's output."""
    import subprocess

    out = tmp_path / "v.json"
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    # as the device recipe runs it: a module of the eval package, from the repository root
    cmd = [sys.executable, "-m", "eval.kernel_variants", "--dry-run", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    shapes = {(r["block_n"], r["int_tile"], r.get("split_slots", 0), tuple(r["record_bytes"])) for r in rows}
    records = {tuple(r["record_bytes"]) for r in rows}
    assert len(records) == 2 and all(n % 16 == 0 for n in max(records))  # the library's records, padded ones
    assert shapes == {(b, t, s, n) for b in (16, 32) for t in (False, True) for s in (0, 32) for n in records}
    for r in rows:
        assert "error" not in r and r["ms"] > 0
        assert r["rel_diff_vs_default"] < 1e-5  # fp32 toy shape: IEEE products, any block size
        assert r["rel_diff_vs_reference"] < 1e-5  # the torch twin's fp32 attention on the same storage
        assert r["probs_rel_diff_vs_reference"] < 1e-5  # and its per-slot probabilities (the keys' side)
        assert r["rel_diff_vs_first_storage"] == 0.0  # the same tokens, read from padded records
