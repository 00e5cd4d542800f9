"""Cache statistics as a person reads them, what a budget counts, and where statistics sit among the modules.

The budget accounting checked here is the one docs/generate.md states ("What `budget` counts"): the
bound is computed from the config, the model's shape and the page size alone, never from the tensors
the cache holds, so a cache that held more than the documented terms allow fails it.
"""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import hfkv
from hfkv.states import STATE_ORDER
from tests.models import tiny_model

ROOT = Path(__file__).resolve().parent.parent
PROMPT, NEW = 300, 21  # 20 decode steps are fed back after the prompt
ROWS, HEADS, DIM, LAYERS = 2, 2, 32, 2  # tests/models.py COMMON: 4 query heads of 32 over 2 KV heads
BUDGET, WINDOW = 48, 8


# --------------------------------------------------------------------------------------- helpers
def _generate(preset: str, dtype: torch.dtype, **overrides) -> hfkv.TriStateCache:
    model = tiny_model("llama", dtype=dtype)
    ids = torch.randint(3, 128, (ROWS, PROMPT), generator=torch.Generator().manual_seed(11))
    cfg = hfkv.TriStateConfig.from_preset(preset, budget=BUDGET, window=WINDOW, obs_window=8, **overrides)
    cache = hfkv.TriStateCache(model, cfg)
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW,
        do_sample=False,
        past_key_values=cache,
        pad_token_id=0,
    )
    assert cache.get_seq_length() == PROMPT + NEW - 1
    return cache


def _field_bytes(fmt: str, dtype_bytes: int, group: int = 32) -> int:
    """One key or value of a token: its codes plus an fp16 scale and an fp16 zero per group of 32."""
    if fmt == "model":
        return DIM * dtype_bytes
    bits = {"int8": 8, "int4": 4, "int2": 2}[fmt]
    return DIM * bits // 8 + 4 * (DIM // group)


def _record_bytes(key: str, value: str, dtype_bytes: int) -> int:
    """A tier record: key + value, padded to 4 bytes, then an int32 tag and an fp32 score sum."""
    kv = _field_bytes(key, dtype_bytes) + _field_bytes(value, dtype_bytes)
    return -(-kv // 4) * 4 + 8


def _storage_bound(records_room: int, records: list[int], ring_slots: int, token_bytes: int, page: int) -> int:
    """Bytes one layer may hold when each (row, KV head) keeps at most ``records_room`` bytes of records of
    the sizes ``records`` (the tiers it uses): the terms docs/generate.md lists, computed from the geometry."""
    heads = ROWS * HEADS
    tpp = [page // r for r in records]
    # whole pages per tier: at most one partly filled page per tier, and each page tiles records with waste
    waste = max(page / (t * r) for t, r in zip(tpp, records, strict=True))
    pages_per_head = math.floor(waste * records_room / page) + len(records)
    table_entries = sum(math.ceil((records_room // r) / t) for t, r in zip(tpp, records, strict=True))
    ring = heads * ring_slots * (token_bytes + 4) + 8 * ring_slots  # K, V, score per slot; positions per layer
    pool = (1 + heads * pages_per_head) * (page + 4)  # the zero page + pages in use, each with a free-stack id
    return ring + pool + 4 * heads * table_entries + 8 * 3 * heads  # page tables, tier counts


def _tokens(stats: hfkv.CacheStats) -> pd.DataFrame:
    """``[layer, row, kv_head] x state`` token counts from the tidy frame."""
    frame = stats.to_dataframe()
    return frame.pivot_table(
        index=["layer", "row", "kv_head"], columns="state", values="tokens", aggfunc="sum", observed=True
    )


# ------------------------------------------------------------------------- what a budget counts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_budget_holds_what_the_docs_say(dtype):
    """``hfkv``: ring + records per KV head fill the cap (to within one record) and never pass it; kv_bytes
    is the cap plus the page bookkeeping, each term bounded from the geometry alone."""
    cache = _generate("hfkv", dtype)
    cfg, st = cache.config, cache.stats()
    s = torch.empty((), dtype=dtype).element_size()
    token = 2 * DIM * s  # one full-precision token's keys and values: what DynamicCache holds per token
    cap = BUDGET * token
    ring_slots = cfg.window + cfg.interval
    room = int(cfg.slack * (cap - ring_slots * (token + 4)))
    records = {
        "original": _record_bytes("model", "model", s),
        "mid": _record_bytes(cfg.mid.key, cfg.mid.value, s),
        "quantized": _record_bytes(cfg.quantized.key, cfg.quantized.value, s),
    }
    for layer in cache.layers:  # the cache's records are the documented ones
        assert [lay.nbytes for lay in layer.layouts] == list(records.values())
    assert st.budget_bytes == LAYERS * ROWS * HEADS * cap
    counts = _tokens(st)
    held = sum(counts[name] * size for name, size in records.items())  # record bytes per (layer, row, head)
    assert counts["quantized"].sum() > 0 and counts["evicted"].sum() > 0  # a real squeeze
    assert (held <= room).all() and (held + ring_slots * (token + 4) <= cap).all()
    assert (held > room - records["original"]).all()  # the budget is spent, not left idle

    page = cache.layers[0].tiers.pool.page_bytes
    upper = LAYERS * _storage_bound(room, list(records.values()), ring_slots, token, page)
    lower = LAYERS * (ROWS * HEADS * ring_slots * (token + 4) + page) + int(held.sum())
    assert lower <= st.kv_bytes <= upper, (lower, st.kv_bytes, upper, st.budget_bytes)
    # what print(stats) says about it
    text = " ".join(str(st).split())  # the budget line wraps
    assert f"budget: {BUDGET:,} fp_tokens per KV head = {cap:,} B" in text
    assert f"held {sum(ls.kv_bytes for ls in st.layers) / st.budget_bytes:.1%} of it" in text


def test_token_budget_holds_what_the_docs_say():
    """``evict``: window + kept tokens per KV head stay within the budget (tiers within budget - window);
    bytes are those records, the whole ring and the same page bookkeeping."""
    cache = _generate("evict", torch.float32)
    cfg, st = cache.config, cache.stats()
    token = 2 * DIM * 4
    record = _record_bytes("model", "model", 4)  # exact tokens only
    assert record == token + 8
    counts = _tokens(st)
    kept = counts["original"] + counts["mid"] + counts["quantized"]
    assert (counts["mid"] + counts["quantized"]).sum() == 0 and counts["evicted"].min() > 0
    assert (kept + counts["window"] <= BUDGET).all() and (counts["window"] >= WINDOW).all()
    assert (kept >= math.floor(cfg.slack * (BUDGET - WINDOW))).all()  # tailored down to slack x (B - W), no lower
    assert st.budget_bytes is None

    ring_slots = cfg.window + cfg.interval
    page = cache.layers[0].tiers.pool.page_bytes
    upper = LAYERS * _storage_bound((BUDGET - WINDOW) * record, [record], ring_slots, token, page)
    lower = LAYERS * (ROWS * HEADS * ring_slots * (token + 4) + page) + int(kept.sum()) * record
    assert lower <= st.kv_bytes <= upper, (lower, st.kv_bytes, upper)
    most = int((kept + counts["window"]).max())
    assert f"budget: {BUDGET:,} tokens per KV head" in str(st) and f"the fullest head holds {most:,}" in str(st)


# ------------------------------------------------------------------------------ how stats read
@pytest.fixture(scope="module")
def hfkv_stats():
    return _generate("hfkv", torch.float32).stats()


def test_print_gives_tokens_per_kv_head_that_add_up_to_the_length(hfkv_stats):
    st = hfkv_stats
    text = str(st)
    lines = text.splitlines()
    assert lines[0].startswith(
        f"CacheStats (hfkv): 2 layers (2 compressed), 2 batch rows x 2 KV heads, {PROMPT + NEW - 1}"
    )
    assert f"compression_ratio={st.compression_ratio:.2f}x" in lines[1]  # tests/test_docs_examples.py reads it
    assert "tokens per KV head in each state (mean over 2 rows x 2 KV heads; they add up to len" in text
    header = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["layer", "len"])
    assert lines[header].split()[-5:] == list(STATE_ORDER)
    for ls, line in zip(st.layers, lines[header + 1 :], strict=True):
        cells = line.split()
        per_head = [float(c.replace(",", "")) for c in cells[-5:]]
        assert per_head == pytest.approx([ls.totals()[n] / 4 for n in STATE_ORDER], abs=0.05)
        assert sum(per_head) == pytest.approx(ls.logical_length, abs=0.3)
        assert int(cells[1].replace(",", "")) == ls.logical_length
        assert sum(ls.per_head().values()) == pytest.approx(ls.logical_length)


def test_summary_is_one_line_with_the_shares(hfkv_stats):
    st = hfkv_stats
    line = st.summary()
    assert "\n" not in line and len(line) < 200
    assert line.startswith(f"hfkv: 2 layers x 2 KV heads x 2 rows, {PROMPT + NEW - 1} tokens; ")
    assert f"({st.compression_ratio:.2f}x, " in line and "% of budget" in line
    totals = {n: sum(ls.totals()[n] for ls in st.layers) for n in STATE_ORDER}
    assert f"{round(100 * totals['evicted'] / sum(totals.values()))}% evicted" in line
    empty = hfkv.TriStateCache(tiny_model("llama"), "hfkv").stats()
    assert empty.summary() == "hfkv: empty (nothing cached yet)"
    assert "budget: 1,024 fp_tokens per KV head; nothing cached yet" in str(empty)


def test_to_dataframe_is_tidy_and_narrow(hfkv_stats):
    frame = hfkv_stats.to_dataframe()
    assert list(frame.columns) == ["layer", "row", "kv_head", "state", "tokens"]
    assert len(frame) == LAYERS * ROWS * HEADS * len(STATE_ORDER)
    assert list(frame["state"].cat.categories) == list(STATE_ORDER)
    with pd.option_context("display.width", 80, "display.max_columns", None):
        shown = repr(frame.head())
    assert "..." not in shown and all(c in shown for c in frame.columns)  # nothing hidden at the default width
    # bytes live per layer, in layer_frame, and its counts are the frame's sums
    per_layer = hfkv_stats.layer_frame().set_index("layer")
    sums = frame.groupby(["layer", "state"], observed=True)["tokens"].sum().unstack()
    for name in STATE_ORDER:
        assert per_layer[name].tolist() == sums[name].tolist()
    assert per_layer["kv_bytes"].sum() == hfkv_stats.kv_bytes


def test_sliding_layers_count_what_they_dropped_as_evicted():
    model = tiny_model("gemma2", num_hidden_layers=4)  # sliding window 16 on layers 0 and 2
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(9))
    cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("evict", budget=24, window=8))
    model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, past_key_values=cache, pad_token_id=0)
    st = cache.stats()
    dense = [ls for ls in st.layers if not ls.compressed]
    assert dense and all(ls.totals()["evicted"] > 0 for ls in dense)
    for ls in st.layers:
        assert sum(ls.per_head().values()) == ls.logical_length
    assert "0 dense" in str(st)


# ---------------------------------------------------------------------------------- module floors
_PROBE = """
import importlib, sys, types
pkg = types.ModuleType("hfkv")  # the package without its __init__ (which imports the cache for users)
pkg.__path__ = [sys.argv[1]]
sys.modules["hfkv"] = pkg
importlib.import_module(sys.argv[2])
print(" ".join(sorted(m for m in sys.modules if m.startswith("hfkv."))))
"""


def _imported_by(module: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(ROOT / "hfkv"), module], capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


def _imports_anywhere(path: Path) -> set[str]:
    """Every hfkv module a file imports, at the top or inside a function (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.startswith("hfkv")}


def test_statistics_sit_below_the_cache_and_introspection_above_it():
    assert _imported_by("hfkv.stats_html") == {"hfkv.states", "hfkv.stats_html"}
    stats = _imported_by("hfkv.stats")
    assert "hfkv.cache" not in stats and "hfkv.inspect" not in stats, stats
    cache = _imported_by("hfkv.cache")
    assert "hfkv.stats" in cache and "hfkv.inspect" not in cache, cache
    # not even lazily: no import of the cache or of introspection inside a function either
    for name in ("stats.py", "stats_html.py"):
        assert not {m for m in _imports_anywhere(ROOT / "hfkv" / name) if m.startswith(("hfkv.cache", "hfkv.inspect"))}
    assert not {m for m in _imports_anywhere(ROOT / "hfkv" / "cache.py") if m.startswith("hfkv.inspect")}
    # the real package too: importing hfkv (which builds the cache classes) leaves introspection alone
    out = subprocess.run(
        [sys.executable, "-c", "import sys, hfkv; print('hfkv.inspect' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert out.stdout.strip() == "False"


def test_moved_names_still_import_from_hfkv_inspect():
    from hfkv import inspect as hi
    from hfkv import stats_html

    assert hi.stats_html is stats_html.stats_html and hi.STATE_COLORS is stats_html.STATE_COLORS
    assert hi.STATE_ORDER == STATE_ORDER and hi.STATE_LABELS[-1] == "window"
    assert callable(hi.cache_html)


def test_summary_says_what_a_budget_leaves_out_when_held_exceeds_it():
    """A small budget's page tails, page tables and zero pages can take what is held past 100% of the budget (which
    counts records and the window): the line says so where it happens, and only there."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 160), generator=torch.Generator().manual_seed(0))
    lines = {}
    for budget in (24, 4096):
        cache = hfkv.TriStateCache(model, "hfkv", budget=budget, window=4)
        model(input_ids=ids, past_key_values=cache)
        st = cache.stats()
        held = sum(ls.kv_bytes for ls in st.layers if ls.compressed)
        lines[budget] = (held > st.budget_bytes, st.summary())
    assert lines[24][0] and "of budget (it leaves out page tails and tables)" in lines[24][1]
    assert not lines[4096][0] and "leaves out" not in lines[4096][1]
