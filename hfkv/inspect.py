"""What a ``TriStateCache`` keeps, and why: tidy frames, a decode-step memory trace and HTML summaries.

The cache exposes its decisions through a few tensor accessors (``token_states``, ``token_scores``,
``thresholds``, ``oq_ratios``, ``stats``). A notebook wants them as long-format pandas frames it
can plot directly, per layer / KV head / position, without knowing the cache's internals; this
module is that translation, and nothing here reads a private attribute. It also holds the helpers
the accuracy-memory figure needs (Pareto front, a small testbed sweep). See ``docs/notebooks.md``.

It sits with the applications, above the cache and the testbed (it imports ``hfkv.cache`` and, for the sweep,
``hfkv.testbed``). The HTML summaries that ``TriStateCache`` and ``CacheStats`` render themselves with live below
it, in ``hfkv.stats_html``, and are re-exported here (``cache_html``, ``stats_html``, ``STATE_COLORS``), as are the
state names (``hfkv.states``).

pandas is imported lazily: the HTML summaries and the memory trace work without it.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor

from hfkv.atomic import write_atomic
from hfkv.cache import TriStateCache, TriStateLayer
from hfkv.config import TriStateConfig
from hfkv.presets import PRESETS
from hfkv.states import STATE_LABELS, STATE_ORDER
from hfkv.stats_html import STATE_COLORS, stats_html
from hfkv.stats_html import cache_html as _cache_html
from hfkv.storage import cache_bytes
from hfkv.testbed import tasks as testbed_tasks  # read when called (tests replace load_test_set)
from hfkv.testbed.protocol import evaluate

# Every figure and summary uses the same names, order and colours for the states (STATE_LABELS,
# STATE_ORDER from hfkv.states, STATE_COLORS from hfkv.stats_html).
SWEEP_COLUMNS = ("task", "method", "accuracy", "memory_ratio")
# The notebook's small sweep: every compressing preset at three budgets (in its own unit: tokens, or fp_tokens for
# hfkv; 64 is the smallest every preset accepts), DiffKV as designed (no budget).
DEFAULT_SWEEP: tuple[tuple[str, int | None], ...] = (
    *((p, b) for p in ("evict", "quant", "streaming", "arkv", "hfkv") for b in (64, 80, 160)),
    ("diffkv", None),
)
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


# ------------------------------------------------------------------------------------- frames
def compressed_layers(cache: TriStateCache) -> list[int]:
    """Indices of the layers the cache compresses (``full`` preset and sliding layers: none / not these)."""
    _check_cache(cache)
    return [i for i, layer in enumerate(cache.layers) if isinstance(layer, TriStateLayer)]


def layer_frame(cache: TriStateCache):
    """One row per layer: bytes held vs dense, compression, tokens per state and the OQ ratio.

    ``oq_ratio`` is ARKV's per-layer ratio ``rho_l`` (mean over batch rows; NaN when the preset has
    no OQ ratios or no prefill has run), the share of the budget a layer may keep in full precision.
    """
    _check_cache(cache)
    frame = cache.stats().layer_frame()
    oq = cache.oq_ratios() or {}
    frame["oq_ratio"] = [float(oq[i].float().mean()) if i in oq else math.nan for i in frame["layer"]]
    return frame


def head_frame(cache: TriStateCache, row: int = 0):
    """One row per (compressed layer, KV head) of batch row ``row``: tokens per state, tokens kept
    (window + original + mid + quantized) and the head's thresholds ``alpha_h / N``, ``alpha_l / N``.

    Heads of one layer keep different counts when the policy is head-adaptive or thresholds decide;
    this frame is where that shows.
    """
    import pandas as pd  # optional: pandas (an extra)

    _check_row(cache, row)
    rows = []
    layers = set(compressed_layers(cache))
    for ls in cache.stats().layers:
        if ls.layer not in layers:
            continue
        hi, lo = cache.thresholds(ls.layer)
        for h in range(len(ls.window[row])):
            counts = {name: getattr(ls, name)[row][h] for name in STATE_ORDER}
            rows.append(
                {
                    "layer": ls.layer,
                    "head": h,
                    **counts,
                    "kept": counts["window"] + counts["original"] + counts["mid"] + counts["quantized"],
                    "alpha_h_n": float(hi[h]),
                    "alpha_l_n": float(lo[h]),
                }
            )
    columns = ["layer", "head", *STATE_ORDER, "kept", "alpha_h_n", "alpha_l_n"]
    return pd.DataFrame(rows, columns=columns)


def state_grid(cache: TriStateCache, row: int = 0):
    """Wide frame of state codes (``hfkv.states``): index ``(layer, head)``, one column per logical
    position. ``grid.to_numpy()`` is the image of the per-head state map."""
    import pandas as pd  # optional: pandas (an extra)

    _check_row(cache, row)
    blocks, index = [], []
    for layer in compressed_layers(cache):
        states = cache.token_states(layer)[row]  # [H, L]
        blocks.append(states)
        index += [(layer, h) for h in range(states.shape[0])]
    if not blocks:
        return pd.DataFrame(index=pd.MultiIndex.from_tuples([], names=["layer", "head"]))
    data = torch.cat(blocks).numpy()
    return pd.DataFrame(data, index=pd.MultiIndex.from_tuples(index, names=["layer", "head"]))


def token_frame(cache: TriStateCache, row: int = 0, prompt_length: int | None = None):
    """Long frame, one row per (compressed layer, KV head, logical position) of batch row ``row``:
    ``state`` (name), ``code``, ``score`` (the policy's mean significance; NaN once evicted), the
    head's ``alpha_h_n`` / ``alpha_l_n``, and ``part`` (``prompt`` / ``generated``) when
    ``prompt_length`` (tokens of the prompt, padding included) is given."""
    import pandas as pd  # optional: pandas (an extra)

    _check_row(cache, row)
    parts = []
    for layer in compressed_layers(cache):
        states = cache.token_states(layer)[row].numpy()  # [H, L]
        scores = cache.token_scores(layer)[row].numpy()
        hi, lo = cache.thresholds(layer)
        heads, length = states.shape
        head = np.repeat(np.arange(heads), length)
        parts.append(
            pd.DataFrame(
                {
                    "layer": layer,
                    "head": head,
                    "position": np.tile(np.arange(length), heads),
                    "code": states.reshape(-1),
                    "score": scores.reshape(-1),
                    "alpha_h_n": hi.float().numpy()[head],
                    "alpha_l_n": lo.float().numpy()[head],
                }
            )
        )
    columns = ["layer", "head", "position", "state", "code", "score", "alpha_h_n", "alpha_l_n"]
    if not parts:
        return pd.DataFrame(columns=columns + (["part"] if prompt_length is not None else []))
    frame = pd.concat(parts, ignore_index=True)
    frame["state"] = pd.Categorical(frame["code"].map(STATE_LABELS), categories=list(STATE_ORDER))
    frame = frame[columns]
    if prompt_length is not None:
        frame["part"] = np.where(frame["position"] < prompt_length, "prompt", "generated")
    return frame


# ------------------------------------------------------------------------------ memory trace
class MemoryTrace(LogitsProcessor):
    """KV bytes held after every forward pass of ``generate``, measured from the cache's tensors.

    Pass it as a logits processor: ``model.generate(..., past_key_values=cache,
    logits_processor=LogitsProcessorList([MemoryTrace(cache)]))``. ``generate`` calls logits
    processors once per forward pass, right after the cache was updated, so entry 0 is the cache
    after prefill and entry ``i`` the cache after decode step ``i``: one entry per generated token
    (the last token is never fed back, so the last entry equals ``cache.stats()`` after ``generate``).
    Works with any transformers cache (``hfkv.storage.cache_bytes``); for a ``TriStateCache`` it also
    records what a DynamicCache would hold (``dense_bytes``) and the token counts per state.
    """

    def __init__(self, cache) -> None:
        if not hasattr(cache, "layers"):
            raise TypeError(f"MemoryTrace: cache must be a transformers Cache, got {type(cache).__name__}")
        self.cache = cache
        self.records: list[dict] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.record()
        return scores

    def record(self) -> None:
        """Append the cache's current size (also usable by hand, e.g. in a manual decode loop)."""
        entry: dict = {"step": len(self.records), "tokens": int(self.cache.get_seq_length())}
        if isinstance(self.cache, TriStateCache):
            st = self.cache.stats()
            entry |= {"kv_bytes": int(st.kv_bytes), "dense_bytes": int(st.dense_bytes)}
            for ls in st.layers:
                for name, n in ls.totals().items():
                    entry[name] = entry.get(name, 0) + n
        else:
            entry |= {"kv_bytes": int(cache_bytes(self.cache)), "dense_bytes": math.nan}
        self.records.append(entry)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def kv_bytes(self) -> list[int]:
        return [r["kv_bytes"] for r in self.records]

    def frame(self):
        """One row per forward pass: ``step``, ``tokens`` (logical length), ``kv_bytes``, ``dense_bytes``
        and, for a TriStateCache, the tokens per state summed over layers, rows and heads."""
        import pandas as pd  # optional: pandas (an extra)

        return pd.DataFrame(self.records)


# -------------------------------------------------------------------- accuracy vs memory
def pareto_front(frame, memory: str = "memory_ratio", accuracy: str = "accuracy"):
    """Boolean Series: rows that no other row dominates (no more memory and no less accuracy, one of
    them strictly). Equal points are all on the front; rows with a NaN are never on it."""
    import pandas as pd  # optional: pandas (an extra)

    for col in (memory, accuracy):
        if col not in frame.columns:
            raise KeyError(f"pareto_front: column {col!r} not in the frame (columns: {list(frame.columns)})")
    m = frame[memory].to_numpy(dtype=float)
    a = frame[accuracy].to_numpy(dtype=float)
    ok = ~(np.isnan(m) | np.isnan(a))
    no_worse = (m[None, :] <= m[:, None]) & (a[None, :] >= a[:, None])  # [i, j]: j is no worse than i
    better = (m[None, :] < m[:, None]) | (a[None, :] > a[:, None])
    dominated = (no_worse & better & ok[None, :]).any(axis=1)
    return pd.Series(ok & ~dominated, index=frame.index, name="pareto")


def sweep_label(method: str, budget) -> str:
    """``"hfkv@80"``; a method without a budget (DynamicCache, ``diffkv``) or one whose name already
    carries it (``"evict@80"`` in ``eval/results``) keeps its name."""
    if budget is None or (isinstance(budget, float) and math.isnan(budget)) or "@" in str(method):
        return str(method)
    return f"{method}@{int(budget)}"


def _with_labels(frame):
    """``label`` per row (``method@budget``) and ``family`` (the preset, else the method) to colour by."""
    budgets = frame["budget"] if "budget" in frame.columns else [None] * len(frame)
    labels = [sweep_label(m, b) for m, b in zip(frame["method"], budgets, strict=True)]
    family = frame["preset"].fillna(frame["method"]) if "preset" in frame.columns else frame["method"]
    return frame.assign(label=labels, family=family.astype(str))


def load_sweep(path: str | os.PathLike, task: str | None = None, dtype: str | None = None):
    """Rows of a sweep result file (JSON lines with at least ``task, method, accuracy, memory_ratio``,
    as ``eval/results/testbed_sweep.jsonl``), filtered by ``task`` / ``dtype``, with ``label`` and ``family``."""
    import pandas as pd  # optional: pandas (an extra)

    frame = pd.read_json(path, lines=True)
    missing = [c for c in SWEEP_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: sweep rows lack column(s) {missing}; needed: {list(SWEEP_COLUMNS)}")
    if task is not None:
        if task not in set(frame["task"]):
            raise ValueError(f"{path}: task={task!r} has no rows; tasks present: {sorted(set(frame['task']))}")
        frame = frame[frame["task"] == task]
    if dtype is not None and "dtype" in frame.columns:
        if dtype not in set(frame["dtype"]):
            raise ValueError(f"{path}: dtype={dtype!r} has no rows; dtypes present: {sorted(set(frame['dtype']))}")
        frame = frame[frame["dtype"] == dtype]
    return _with_labels(frame).reset_index(drop=True)


def testbed_sweep(
    model,
    tok,
    task: str = "kv_recall",
    configs: Sequence[tuple[str, int | None]] = DEFAULT_SWEEP,
    limit: int = 20,
    batch_size: int = 10,
    progress: bool = False,
):
    """Accuracy vs memory of DynamicCache and each ``(preset, budget)`` of ``configs`` (budget None:
    the preset's own) on the first ``limit`` examples of a testbed test set
    (``hfkv.testbed.protocol.evaluate``: greedy, exact match, bytes read from the tensors). Columns as
    ``eval/results/testbed_sweep.jsonl``: ``memory_ratio`` = KV bytes held / what a DynamicCache holds
    for the same tokens, ``compression`` its inverse."""
    import pandas as pd  # optional: pandas (an extra)

    if task not in testbed_tasks.TASKS:
        raise ValueError(f"testbed_sweep: task={task!r}; allowed: {sorted(testbed_tasks.TASKS)}")
    for preset, budget in configs:
        if preset not in PRESETS:
            raise ValueError(f"testbed_sweep: configs has preset={preset!r}; allowed: {list(PRESETS)}")
        TriStateConfig.from_preset(preset, budget=budget)  # as evaluate() builds it: fail before running
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"testbed_sweep: limit={limit!r} must be an integer >= 1")

    data = testbed_tasks.load_test_set(task)[:limit]
    rows = []
    bar = tqdm(total=len(data) * (1 + len(configs)), desc=task, leave=False, disable=not progress)
    for preset, budget in [(None, None), *configs]:
        bar.set_postfix_str(sweep_label(preset or "DynamicCache", budget))
        r = evaluate(model, tok, task, data, preset, budget, batch_size, bar=bar)
        rows.append(
            {
                "task": task,
                "method": preset or "DynamicCache",
                "preset": preset,
                "budget": budget,
                "dtype": _DTYPE_NAMES.get(model.dtype, str(model.dtype)),
                "n": r["n"],
                "accuracy": r["accuracy"],
                "memory_ratio": 1.0 / r["compression"],
                "compression": r["compression"],
                "kv_kib": r["kv_kib"],
            }
        )
    bar.close()
    return _with_labels(pd.DataFrame(rows))


# ------------------------------------------------------------------------------- figures
def save_figure(fig, folder: str | os.PathLike | None, name: str, dpi: int = 110) -> str | None:
    """Write ``fig`` as ``folder/name.png`` atomically (:func:`hfkv.atomic.write_atomic`) when ``folder`` is
    set; None otherwise. The notebook calls it for every figure, so a test run leaves PNGs behind
    (``HFKV_FIGURES_DIR``) and an interrupted run never leaves a truncated one."""
    if not folder:
        return None
    if not name or os.sep in name or name != os.path.basename(name):
        raise ValueError(f"save_figure: name={name!r} must be a plain file name without a folder")
    path = os.path.join(folder, f"{name}.png")
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, bbox_inches="tight", format="png")
    write_atomic(path, buf.getvalue())
    return path


# --------------------------------------------------------------------------------- HTML
def cache_html(cache: TriStateCache) -> str:
    """What ``TriStateCache._repr_html_`` shows: config, memory, budget, and per layer compression, tokens per
    KV head in each state and the OQ ratio (rendered by ``hfkv.stats_html.cache_html``)."""
    _check_cache(cache)
    return _cache_html(cache.stats(), cache.config.summary(), len(cache.layers), cache.oq_ratios())


# ------------------------------------------------------------------------------- checks
def _check_cache(cache) -> None:
    if not isinstance(cache, TriStateCache):
        raise TypeError(f"expected a hfkv.TriStateCache, got {type(cache).__name__}")


def _check_row(cache: TriStateCache, row: int) -> None:
    _check_cache(cache)
    layers = [ls for ls in cache.stats().layers if ls.window]
    if not layers:
        raise ValueError("the cache is empty: run model.generate (or a forward pass) with it first")
    rows = len(layers[0].window)
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < rows:
        raise ValueError(f"row={row!r} is out of range: the cache holds batch rows 0..{rows - 1}")


__all__ = [
    "DEFAULT_SWEEP",
    "STATE_COLORS",
    "STATE_LABELS",
    "STATE_ORDER",
    "MemoryTrace",
    "cache_html",
    "compressed_layers",
    "head_frame",
    "layer_frame",
    "load_sweep",
    "pareto_front",
    "save_figure",
    "sweep_label",
    "state_grid",
    "stats_html",
    "testbed_sweep",
    "token_frame",
]
