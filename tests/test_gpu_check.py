"""``python -m eval.gpu.check --dry-run``: every part of the GPU check runs on a CPU and writes its files.

A lent GPU is a few minutes long and starts bare, so the command must work the first time there:
the dry run builds and launches every part (the pytest run through the offload plugin, the
on-device checks, the bandwidth cases, the end-to-end caches) in Triton's interpreter at toy sizes,
and writes the same JSON, summary and figure. The bookkeeping that decides what a real run does
(deadlines, test outcomes, argument errors) is checked on its own.
"""

from __future__ import annotations

import json
import os

import pytest

from eval.gpu import check as gpu_check
from hfkv.kernels.environment import interpreter_on


@pytest.mark.skipif(not interpreter_on(), reason="the dry run is the CPU rehearsal (Triton's interpreter)")
def test_dry_run_runs_every_part_and_writes_the_files(tmp_path, capsys, frozen_heap):
    out = tmp_path / "out"
    assert gpu_check.main(["--dry-run", "--out", str(out), "--budget-s", "900"]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "gpu_check.json").read_text())
    summary = (out / "summary.txt").read_text()
    assert (out / "gpu_check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary == result["summary"] and summary in printed
    assert "DRY RUN" in summary
    assert result["dry_run"] is True and result["device_kind"] == "cpu" and result["complete"] is True
    assert 0 < result["elapsed_s"] < result["budget_s"] == 900
    for key in ("torch", "triton", "transformers", "hfkv_version", "date", "args"):
        assert key in result
    from hfkv.kernels import decode_attention as da

    launch = result["decode_launch"]  # the decode kernel's defaults this code ran with
    assert launch["column_sums"] is da.COLUMN_SUMS and launch["half_dequant"] is da.HALF_DEQUANT
    assert (launch["block_n"], launch["num_warps"], launch["max_registers"]) == (da.BLOCK_N, da.NUM_WARPS, None)
    parts = result["parts"]
    assert set(parts) == {"tests", "bandwidth", "e2e"}
    assert all(p["status"] == "ok" and p["seconds"] > 0 for p in parts.values())

    tests = parts["tests"]
    py = tests["pytest"]
    assert py["passed"] >= 3 and py["failed"] == py["error"] == 0 and not py["timed_out"]
    assert py["collected"] == py["passed"] + py["skipped"] and py["not_run"] == []  # the selection, all reported
    assert "gpu_offload" in py["command"] and py["interpreter"] is True
    names = [c["name"] for c in tests["checks"]]
    assert any(n.startswith("generate llama quant") for n in names) and any("host sync" in n for n in names)
    assert all(c["ok"] for c in tests["checks"]), tests["checks"]

    bw = parts["bandwidth"]
    assert bw["copy_bandwidth"]["gbps"] > 0
    assert {(r["kind"], r["batch"]) for r in bw["rows"]} == {(k, b) for k in ("full", "quant", "hfkv") for b in (1, 2)}
    for r in bw["rows"]:
        assert r["status"] == "ok", r
        assert r["read_bytes"] > 0 and r["ms"] > 0 and r["read_fraction"] > 0 and r["sdpa"]["ms"] > 0
    assert [r["check"]["ok"] for r in bw["rows"] if "check" in r] == [True] * 3  # the first case of each kind
    assert set(bw["targets"]["kernel_bandwidth"]) >= {"full", "quant", "hfkv"}

    e2e = parts["e2e"]
    methods = {r["method"] for r in e2e["rows"]}
    assert e2e["sdpa_backends"] == "flash,efficient,math"  # cuDNN's per-length plans out of the baseline
    assert {"dynamic", "hfkv@48:backend=triton", "hfkv@64:backend=triton"} <= methods
    assert ("quanto-int4" in methods) == e2e["quantized_cache"]["available"]
    for r in e2e["rows"]:
        assert r["status"] == "ok", r
        for key in ("prefill_s", "decode_ms_median", "decode_ms_mean", "peak_bytes", "kv_bytes", "compression"):
            assert r[key] > 0, (key, r)
        assert r["backend"] == ("triton" if r["kind"] == "tristate" else "transformers")
        assert r["decode_speedup_median"] > 0  # against the DynamicCache row of its group
        assert r["steps_that_compiled"] == 0  # the interpreter compiles nothing
        kept = r["kind"] in ("dynamic", "tristate")  # stepped in turns after their own steps; QuantizedCache not
        assert ("interleaved" in r) == kept, r
        if kept:
            assert r["interleaved"]["steps"] == 2 and r["interleaved"]["decode_ms_median"] > 0
            assert r["interleaved"]["with"] == sorted(["dynamic", "hfkv@48:backend=triton", "hfkv@64:backend=triton"])
            assert r["decode_speedup_mean_interleaved"] > 0
    groups = [(r["context"], r["batch"]) for r in e2e["rows"]]
    for g in dict.fromkeys(groups):  # DynamicCache's row first in each group, though it ran last
        assert next(r for r in e2e["rows"] if (r["context"], r["batch"]) == g)["method"] == "dynamic"
    assert e2e["max_batch"] == {}
    assert e2e["graph_capture"]["status"] == "skipped" and "CUDA" in e2e["graph_capture"]["reason"]
    # a CPU has no memory limit to find and no CUDA graphs (tests/test_graph_replay.py checks the replays there)
    skipped = {s["item"] for s in result["skipped"]}
    assert skipped == {"largest batch", "graphed hfkv rows", "CUDA graph replay check", "run-ahead sync check"}


def test_budget_deadlines_give_unused_time_to_later_parts():
    now = [100.0]
    budget = gpu_check.Budget(200.0, clock=lambda: now[0])
    assert budget.left("tests") == pytest.approx(200 * gpu_check.DEADLINES["tests"])
    now[0] += 10  # the tests part ended early: the next part's deadline did not move
    assert budget.left("bandwidth") == pytest.approx(200 * gpu_check.DEADLINES["bandwidth"] - 10)
    assert budget.allows("bandwidth", "small", 5.0)
    assert not budget.allows("tests", "big", 1000.0)
    assert budget.skipped == [{"part": "tests", "item": "big", "reason": budget.skipped[0]["reason"]}]
    assert "needs about 1000 s" in budget.skipped[0]["reason"]


def test_pytest_outcomes_count_each_test_once_by_its_worst_phase():
    lines = [
        json.dumps({"test": "a", "when": "call", "outcome": "passed"}),
        json.dumps({"test": "b", "when": "call", "outcome": "failed", "message": "E   assert 1 == 2"}),
        json.dumps({"test": "c", "when": "setup", "outcome": "skipped"}),
        json.dumps({"test": "d", "when": "call", "outcome": "passed"}),
        json.dumps({"test": "d", "when": "teardown", "outcome": "failed", "message": "boom"}),
        "",
    ]
    got = gpu_check.pytest_outcomes(lines)
    assert (got["passed"], got["failed"], got["skipped"], got["error"]) == (1, 1, 1, 1)
    assert [(f["test"], f["outcome"]) for f in got["failures"]] == [("b", "failed"), ("d", "error")]
    assert got["not_run"] is None  # no collected line: unknown, not "none"
    # the selected tests (one line, gpu_offload's) name those a run stopped at its deadline never reported
    got = gpu_check.pytest_outcomes([json.dumps({"collected": ["a", "b", "c", "d", "e", "f"]}), *lines])
    assert (got["collected"], got["not_run"]) == (6, ["e", "f"])


@pytest.mark.parametrize(
    "argv,option,words",
    [
        (["--contexts", "16"], "--contexts", "must exceed 24"),
        (["--parts", "test"], "--parts", "did you mean 'tests'"),
        (["--budget-s", "5"], "--budget-s", "between 30 and 3600"),
        (["--kinds", "full,int4"], "--kinds", "'int4' is not a storage kind"),
        (["--e2e-batches", "0"], "--e2e-batches", "positive integer"),
        (["--e2e-sdpa", "flash,cudnn2"], "--e2e-sdpa", "cudnn2 not allowed"),
        (["--e2e-extra", "hfkv@1024:intervall=32"], "--e2e-extra", "interval"),
    ],
)
def test_bad_arguments_are_named_before_anything_runs(tmp_path, capsys, argv, option, words):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m eval.gpu.check: error: " + option) and words in err
    assert not (tmp_path / "x").exists()


def test_a_real_run_needs_cuda_and_compiled_kernels(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "x")]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_check.main(["--out", str(tmp_path / "x")]) == 2
    assert "TRITON_INTERPRET=1 would run the kernels in Triton's interpreter" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_largest_batch_is_predicted_from_two_peaks():
    from eval.gpu.e2e import predict_max_batch

    gib = 1 << 30
    p = predict_max_batch([(1, 20 * gib), (8, 48 * gib)], free_bytes=80 * gib)  # 4 GiB per row over 16 GiB
    assert p["per_row_bytes"] == 4 * gib and p["fixed_bytes"] == 16 * gib
    assert p["predicted"] == int((80 * gib * 0.95 - 16 * gib) // (4 * gib)) == 15
    assert predict_max_batch([(1, gib), (8, gib)], 80 * gib)["predicted"] is None  # no growth: nothing to find


def test_ratios_are_taken_against_dynamic_cache_of_the_same_group():
    from eval.gpu.e2e import add_ratios

    def row(method, context, ms, peak, kv, status="ok"):
        return dict(method=method, context=context, batch=1, status=status, decode_ms_median=ms, decode_ms_mean=ms,
                    prefill_s=1.0, peak_bytes=peak, kv_bytes=kv)  # fmt: skip

    rows = [row("dynamic", 8, 10.0, 100, 50), row("hfkv@1", 8, 5.0, 40, 10), row("hfkv@1", 32, 4.0, 1, 1)]
    rows.append(row("quanto-int4", 8, 1.0, 1, 1, status="oom"))
    add_ratios(rows)
    assert rows[1]["decode_speedup_median"] == 2.0 and rows[1]["peak_ratio"] == 0.4 and rows[1]["kv_ratio"] == 0.2
    assert "decode_speedup_median" not in rows[2]  # no DynamicCache row at 32 tokens
    assert "decode_speedup_median" not in rows[3]  # a failed row has no figures


def test_quanto_python_unpack_inverts_quantos_packing():
    packed_mod = pytest.importorskip("optimum.quanto.tensor.packed")
    import torch

    from eval.gpu.e2e import _unpack

    for bits in (2, 4):
        codes = torch.randint(0, 1 << bits, (10, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
        assert torch.equal(_unpack(packed_mod.pack_weights(codes, bits), bits)[:10], codes)


@pytest.mark.skipif(not interpreter_on(), reason="the kernels run in Triton's interpreter here")
def test_offload_copies_storages_once_and_writes_back_into_the_callers_tensors():
    import torch

    from hfkv.kernels.move import move_records
    from tests.gpu_offload import _Mover, offloaded

    pool = torch.arange(64, dtype=torch.uint8).view(2, 32).clone()
    offloaded(move_records, "cpu")(pool, torch.tensor([0]), torch.tensor([32]), 8)
    assert torch.equal(pool.view(-1)[32:40], torch.arange(8, dtype=torch.uint8))  # written on a copy, copied back
    assert torch.equal(pool.view(-1)[40:], torch.arange(40, 64, dtype=torch.uint8))
    mover = _Mover(torch.device("cpu"))
    whole, row = mover(pool), mover(pool[1])  # two views of one storage: one copy, the same views of it
    assert whole.data_ptr() != pool.data_ptr() and row.data_ptr() == whole.data_ptr() + 32
    assert len(mover.storages) == 1

    def fill(x, out):  # a call that writes its result into ``out`` and returns it, as run_plan(out=) does
        out.copy_(x + 1)
        return out, x + 2

    x, out = torch.zeros(3), torch.empty(3)
    res, other = offloaded(fill, "cpu")(x, out)
    assert res is out and torch.equal(out, torch.ones(3))  # the caller's own tensor, written
    assert other is not x and torch.equal(other, torch.full((3,), 2.0))


@pytest.mark.skipif(not interpreter_on(), reason="the kernels run in Triton's interpreter here")
def test_offload_routes_every_launch_of_a_generate_through_the_wrappers(monkeypatch):
    """A cache that launches through an entry point the plugin does not wrap hands CPU pointers to a GPU
    (the second H200 run: the cache's kept plan, ``run_plan``): every launch must happen inside a wrapper."""
    import importlib

    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from hfkv import TriStateCache
    from tests import gpu_offload
    from tests.models import tiny_model

    for module_name, name in gpu_offload.WRAPPED:
        module = importlib.import_module(module_name)
        monkeypatch.setattr(module, name, gpu_offload.offloaded(getattr(module, name), "cpu"))
    launches, outside = [], []
    run = InterpretedFunction.run

    def record(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        if gpu_offload.ACTIVE[0] == 0:
            outside.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", record)
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    # an eviction floor: every policy run is a full one (metadata read), not admit-only
    cache = TriStateCache(model, "hfkv", backend="triton", budget=16, window=4, alpha_l=0.05)
    model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
    # decode steps, and full policy runs that read the tiers' metadata
    assert {"_partial_kernel", "_encode_write_kernel", "_candidates_kernel"} <= set(launches)
    assert outside == []


def test_extra_caches_run_hfkv_on_triton_unless_told_and_keep_short_labels():
    from eval.gpu.e2e import GRAPHED, extra_methods
    from eval.gpu.report import _short

    got = extra_methods(["hfkv@1024:interval=32", "evict@512,hfkv@256:backend=torch", "dynamic"])
    assert [m.label for m in got] == [
        "hfkv@1024:interval=32,backend=triton", "evict@512:backend=triton", "hfkv@256:backend=torch", "dynamic"
    ]  # fmt: skip
    assert got[0].config.interval == 32 and got[0].config.backend == "triton"
    assert [_short(m.label + GRAPHED) for m in got[:2]] == ["hfkv@1024:interval=32 graphed", "evict@512 graphed"]


def _poisoning_check(flag: str) -> tuple[bool, str]:
    """Leaves its process changed, as a failed CUDA graph capture leaves the CUDA generator capturing, and fails."""
    os.environ[flag] = "poisoned"
    raise RuntimeError("capture failed half-way")


def _passing_check(x: int) -> tuple[bool, str]:
    return True, f"{x} and pid {os.getpid()}"


def test_isolated_checks_run_in_a_process_of_their_own(monkeypatch):
    """A check run by ``isolated`` fails as a result, not an exception, and what it did to its process does not
    reach the caller's (run 14: a failed capture left the e2e part unable to draw random weights)."""
    from eval.gpu.check import _graph_check_in, isolated

    monkeypatch.delenv("HFKV_TEST_POISON", raising=False)
    ok, detail = isolated(_poisoning_check, "HFKV_TEST_POISON")
    assert not ok and "capture failed half-way" in detail
    assert "HFKV_TEST_POISON" not in os.environ
    ok, detail = isolated(_passing_check, 7)
    assert ok and detail.startswith("7 and pid ") and detail != f"7 and pid {os.getpid()}"
    # the graph check itself finds the tests' helpers in the child and reaches the decoder (which refuses the mode)
    ok, detail = isolated(_graph_check_in, "cpu", "pieces")
    assert not ok and "GraphedDecoder: mode='pieces'" in detail


def test_decode_path_failures_name_the_decode_kernel_and_dequant_tests_only():
    """eval/gpu_lease.sh turns the PTX dequantization off when these fail: a failure elsewhere (or a run without
    tests) must not, and one in either file must."""

    def result(*tests):
        failures = [{"test": t, "outcome": "failed", "message": ""} for t in tests]
        return {"parts": {"tests": {"pytest": {"passed": 3, "failed": len(tests), "failures": failures}}}}

    decode = "tests/test_kernel_decode_attention.py::test_paged_attention_matches[triton-fp16]"
    dequant = "tests/test_kernel_dequant.py::test_dequant[fp16-ptx]"
    other = "tests/test_kernel_encode.py::test_encode[int4]"
    assert gpu_check.decode_path_failures(result(other)) == []
    assert gpu_check.decode_path_failures(result(decode, other, dequant)) == [decode, dequant]
    assert gpu_check.decode_path_failures({"parts": {"e2e": {}}}) == []
    # an option off by default (products from codes) failing says nothing of the default launch's PTX
    opt_in = "tests/test_kernel_decode_attention.py::test_decode_kernel_matches_torch_twin[int4-triton-code-dots]"
    named = "tests/test_kernel_decode_attention.py::test_code_dots_at_length_are_as_close_to_the_twin[int4-int2-32]"
    assert gpu_check.decode_path_failures(result(opt_in, named, decode)) == [decode]


def test_dynamic_cache_keeps_its_time_until_it_was_tried():
    """Every other cache's row must leave DynamicCache's (the ratios' reference, run last) its time until it was
    tried at that context and batch; DynamicCache itself, and every row after it, reserve nothing."""
    from types import SimpleNamespace as NS

    from eval.gpu.e2e import _kept_last, reference_reserve

    dyn, hfkv, quanto = NS(kind="dynamic", label="dynamic"), NS(kind="tristate", label="hfkv@1024"), NS(
        kind="quantized", label="quanto-int4")  # fmt: skip
    methods = [dyn, hfkv, quanto]
    need = {"dynamic": 30.0, "hfkv@1024": 20.0, "quanto-int4": 25.0}
    assert [m.label for m in _kept_last(methods, 24)][-1] == "dynamic"  # why it must be reserved for

    def reserve(m, tried):
        return reference_reserve(m, methods, tried, lambda x: need[x.label])

    assert reserve(hfkv, set()) == 30.0 and reserve(quanto, {"hfkv@1024"}) == 30.0
    assert reserve(dyn, {"hfkv@1024", "quanto-int4"}) == 0.0
    assert reserve(hfkv, {"dynamic"}) == 0.0  # tried already (a later graphed row, another cache)
    assert reference_reserve(hfkv, [hfkv, quanto], set(), lambda x: need[x.label]) == 0.0  # no DynamicCache
