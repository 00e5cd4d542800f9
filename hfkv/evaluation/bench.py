"""``hfkv bench``: memory and speed of caches as ratios to a DynamicCache measured in the same process.

A shared machine drifts (another job starts, clocks change), so absolute times from separate runs
cannot be compared; ratios measured side by side can. For every (context, batch) group all caches
are filled with the same random prompt, then timed in turns: the prefills in rounds (method A, B, ...,
then again), the decode steps one step of each cache after the other, so every cache sees the same
machine state. Reported per cache: KV bytes held (``hfkv.storage.cache_bytes``), compression, prefill
time, decode step time (median and mean; the mean includes batched policy runs) and tokens/s, peak
memory, and each as a ratio to DynamicCache.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` over a prefill + decode run of that cache
alone, minus what was allocated before (weights), i.e. cache plus activations. On CPU there is no
allocator counter to read, so the figure is the largest number of bytes the cache held at any point
of the run (sampled after the prefill and after every decode step) — the cache's own peak, not the
process's. On CUDA ``--max-batch-context`` also searches the largest batch that fits at that context
for each cache (the throughput claim of DiffKV and KV-Compress).

Timing is honest only on a quiet machine (:mod:`hfkv.evaluation.quiet`): the run is refused unless the
1-minute load average is below ``--max-load`` (``--wait-quiet``, ``--force-busy``), every group is timed
at each of ``--threads`` (default ``1,all`` on CPU), and each group records the thread count and the
run's loads before and after; a result whose load was not below the limit at both ends is marked busy.

    hfkv bench --random-like cpu-small --methods dynamic,hfkv,evict,quant --budgets 1024 \\
        --contexts 512,2048,8192 --dtype fp32 --name cpu_small_fp32

writes ``hfkv-out/bench/cpu_small_fp32.{json,csv,png}`` under the working directory (``--out-dir``); the
committed results in ``eval/results/bench/`` are rewritten only by naming that folder (``make results-bench``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm

from hfkv import cli_args as ca
from hfkv.atomic import write_atomic
from hfkv.evaluation import quiet
from hfkv.evaluation.methods import expand_methods, method_specs, parse_budget, split_specs
from hfkv.evaluation.quiet import parse_threads, verdict
from hfkv.evaluation.results import git_commit, json_safe, machine_name, provenance
from hfkv.evaluation.shapes import SHAPES, build_random_like, get_shape
from hfkv.storage.memory import cache_bytes

DEFAULT_METHODS = "dynamic,hfkv,evict,quant"
# A run writes under the working directory's hfkv-out/ (gitignored), never over the committed results: those
# (RESULTS_DIR) are regenerated only by naming the folder, as `make results-bench` does.
DEFAULT_OUT = "hfkv-out/bench"
RESULTS_DIR = "eval/results/bench"


# ------------------------------------------------------------------------------------- SDPA backends
# --sdpa's names -> torch.nn.attention.SDPBackend members
SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH", "cudnn": "CUDNN_ATTENTION"
}  # fmt: skip
# Without cuDNN: torch 2.11 picks cuDNN attention for a decode step on an H200, and cuDNN builds a plan for
# every new key length: ~1.3 ms of host time a layer, 42 of DynamicCache's ~70 ms step at 8k x 8 (gpu_check
# run 12, eval/archive/interleave_probe.py), or nothing where an earlier cache already stepped through those lengths.
BASELINE_SDPA = "flash,efficient,math"


def sdpa_backends(spec: str):
    """A context in which torch's SDPA may use only the backends of ``spec`` ("flash,efficient,math"), in
    that order of priority; "default": torch's own choice. Baselines that call SDPA every step (DynamicCache,
    QuantizedCache) are timed under it so their step does not depend on what ran before."""
    if spec == "default":
        return contextlib.nullcontext()
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in SDPA_BACKENDS]
    if bad or not names:
        raise ValueError(
            f"SDPA backends {spec!r}: {', '.join(bad) or 'none given'} not allowed; "
            f"use 'default' or a comma list of {', '.join(SDPA_BACKENDS)}"
        )
    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[n]) for n in names], set_priority=True)


# ---------------------------------------------------------------------------------------------- timing
class Clock:
    """Wall time of a region: CUDA events on a GPU (no host sync inside the region), perf_counter on CPU.

    ``synced``: on a GPU too, perf_counter between two device synchronisations: each region's whole cost, host
    and device, as ``generate`` sees a step (it reads the finished flags every step). Where the host is the
    bottleneck, unsynchronised events give a region the GPU's idle wait for the next one's launches, and
    regions of different caches in turns trade time."""

    def __init__(self, device: torch.device | str, synced: bool = False):
        self.cuda = torch.device(device).type == "cuda"
        self.synced = synced and self.cuda
        self._pending: list[tuple[Any, Any, list[float], int]] = []

    def start(self):
        if self.synced:
            torch.cuda.synchronize()
            return time.perf_counter()
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, token, into: list[float]) -> None:
        """Append the seconds since ``token`` to ``into`` (for CUDA events once :meth:`resolve` has run)."""
        if self.synced:
            torch.cuda.synchronize()
            into.append(time.perf_counter() - token)
        elif self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            into.append(float("nan"))
            self._pending.append((token, ev, into, len(into) - 1))
        else:
            into.append(time.perf_counter() - token)

    def resolve(self) -> None:
        if self.cuda and self._pending:
            torch.cuda.synchronize()
            for a, b, into, i in self._pending:
                into[i] = a.elapsed_time(b) / 1e3
            self._pending.clear()


def random_prompt(vocab: int, batch: int, context: int, seed: int = 2) -> torch.Tensor:
    """Token ids ``[batch, context]`` in ``[3, vocab)`` (avoids the usual special ids 0-2)."""
    return torch.randint(3, vocab, (batch, context), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def fill_cache(model, cache, ids: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Prefill ``cache`` with ``ids`` (in chunks of ``chunk`` tokens; 0 = one forward); next greedy tokens."""
    ids = ids.to(model.device)
    step = chunk or ids.shape[1]
    out = None
    for s in range(0, ids.shape[1], step):
        out = model(input_ids=ids[:, s : s + step], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1)


@torch.inference_mode()
def decode_step(model, cache, tokens: torch.Tensor, position: int) -> torch.Tensor:
    """One single-token forward of every row at logical ``position``; the next greedy tokens."""
    pos = torch.full((tokens.shape[0], 1), position, dtype=torch.long, device=tokens.device)
    out = model(input_ids=tokens, position_ids=pos, past_key_values=cache, use_cache=True)
    return out.logits[:, -1:].argmax(-1)


def interleaved_decode(
    model,
    caches: dict[str, Any],
    tokens: dict[str, torch.Tensor],
    context: int | dict[str, int],
    steps: int,
    warmup: int = 2,
    clock: Clock | None = None,
    after_step: Callable[[str, Any], None] | None = None,
    progress: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per decode step of each cache, stepping the caches in turns (one step each, repeated).

    Interleaving exposes every cache to the same machine state (a shared VM drifts by 20-30% over a
    minute), so ratios stay trustworthy when absolute times move. The first ``warmup`` steps are
    dropped. ``after_step(name, cache)`` runs outside the timed region (memory sampling). ``context``
    is the position of every cache's next token, or of each cache's (caches that decoded apart first).
    """
    clock = clock or Clock(model.device)
    times: dict[str, list[float]] = {name: [] for name in caches}
    tokens = dict(tokens)
    start = context if isinstance(context, dict) else dict.fromkeys(caches, context)
    for i in range(warmup + steps):
        for name, cache in caches.items():
            t0 = clock.start()
            tokens[name] = decode_step(model, cache, tokens[name], start[name] + i)
            clock.stop(t0, times[name])
            if after_step is not None:
                after_step(name, cache)
            if progress is not None:
                progress()
    clock.resolve()
    return {name: ts[warmup:] for name, ts in times.items()}


def interleaved_decode_times(
    model, caches: dict[str, Any], context: int, steps: int, chunk: int = 1024
) -> dict[str, tuple[float, float]]:
    """``{name: (median, mean)}`` seconds per decode step at ``context`` (caches filled here, chunked)."""
    ids = random_prompt(model.config.vocab_size, 1, context)
    tokens = {name: fill_cache(model, cache, ids, chunk) for name, cache in caches.items()}
    times = interleaved_decode(model, caches, tokens, context, steps)
    return {name: (statistics.median(ts), statistics.fmean(ts)) for name, ts in times.items()}


# ------------------------------------------------------------------------------------ largest batch
def largest_fitting(fits: Callable[[int], bool], cap: int, start: int = 1) -> int:
    """Largest ``b`` in ``[1, cap]`` with ``fits(b)`` (0 if even 1 does not fit), assuming monotonicity.

    Doubles from ``start`` until a batch fails or ``cap`` is reached, then bisects between the last
    batch that fitted and the first that did not: O(log cap) trials, each a real prefill + decode.
    """
    if cap < 1:
        raise ValueError(f"cap={cap} must be >= 1")
    lo, b = 0, max(1, min(start, cap))
    while True:
        if not fits(b):
            hi = b
            break
        lo = b
        if b == cap:
            return cap
        b = min(cap, b * 2)
    while hi - lo > 1:  # lo fits (or is 0), hi does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def cuda_fits(model, method, context: int, decode_steps: int = 2, chunk: int = 0) -> Callable[[int], bool]:
    """``fits(batch)``: a prefill at ``context`` and a few decode steps run without CUDA out-of-memory."""

    def fits(batch: int) -> bool:
        cache = None
        try:
            cache = method.make_cache(model, max_cache_len=context + decode_steps + 1)
            ids = random_prompt(model.config.vocab_size, batch, context)
            tok = fill_cache(model, cache, ids, chunk)
            for i in range(decode_steps):
                tok = decode_step(model, cache, tok, context + i)
            torch.cuda.synchronize()
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            del cache
            gc.collect()
            torch.cuda.empty_cache()

    return fits


# ---------------------------------------------------------------------------------------- one group
def _cache_bytes(cache) -> int:
    return int(cache_bytes(cache))


def _cuda_peak(model, method, ids: torch.Tensor, steps: int, chunk: int) -> int:
    """Peak CUDA bytes allocated above the starting point during a prefill + decode of ``method`` alone."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    cache = method.make_cache(model, max_cache_len=ids.shape[1] + steps + 1)
    tok = fill_cache(model, cache, ids, chunk)
    for i in range(steps):
        tok = decode_step(model, cache, tok, ids.shape[1] + i)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del cache, tok
    return int(peak)


def bench_group(model, methods: list, context: int, batch: int, args, bar=None) -> list[dict[str, Any]]:
    """All methods at one (context, batch): rows with absolute figures and ratios to ``dynamic``."""
    device = model.device
    clock = Clock(device)
    ids = random_prompt(model.config.vocab_size, batch, context).to(device)
    max_len = context + args.warmup + args.decode_steps + 1
    prefill: dict[str, list[float]] = {m.label: [] for m in methods}
    caches: dict[str, Any] = {}
    tokens: dict[str, torch.Tensor] = {}
    peak_held: dict[str, int] = {}
    for _ in range(args.prefill_repeats):
        for m in methods:
            caches.pop(m.label, None)
            gc.collect()
            cache = m.make_cache(model, max_cache_len=max_len)
            t0 = clock.start()
            tok = fill_cache(model, cache, ids, args.prefill_chunk)
            clock.stop(t0, prefill[m.label])
            caches[m.label], tokens[m.label] = cache, tok
            if bar is not None:
                bar.update(1)
    clock.resolve()
    for m in methods:
        peak_held[m.label] = _cache_bytes(caches[m.label])
    prefill_bytes = dict(peak_held)

    def sample(name: str, cache) -> None:
        peak_held[name] = max(peak_held[name], _cache_bytes(cache))

    decode = interleaved_decode(
        model,
        caches,
        tokens,
        context,
        args.decode_steps,
        args.warmup,
        clock,
        after_step=sample,
        progress=(lambda: bar.update(1)) if bar is not None else None,
    )
    final = {m.label: _cache_bytes(caches[m.label]) for m in methods}
    # Which attention path a TriStateCache ran (auto resolves per device); other caches: their own.
    backends = {m.label: getattr(caches[m.label], "backend", "transformers") for m in methods}
    caches.clear()
    gc.collect()
    cuda_peak: dict[str, int] = {}
    if torch.device(device).type == "cuda":
        for m in methods:
            cuda_peak[m.label] = _cuda_peak(model, m, ids, args.warmup + args.decode_steps, args.prefill_chunk)
    max_batch: dict[str, int] = {}
    if torch.device(device).type == "cuda" and args.max_batch_context and context == args.max_batch_context:
        for m in methods:
            max_batch[m.label] = largest_fitting(cuda_fits(model, m, context, 2, args.prefill_chunk), args.max_batch)

    rows = []
    for m in methods:
        pre = statistics.median(prefill[m.label])
        med, mean = statistics.median(decode[m.label]), statistics.fmean(decode[m.label])
        row = {
            **{k: v for k, v in m.describe().items() if k != "config"},
            "context": context,
            "batch": batch,
            "backend": backends[m.label],
            "kv_bytes": final[m.label],
            "kv_bytes_prefill": prefill_bytes[m.label],
            "peak_bytes": cuda_peak.get(m.label, peak_held[m.label]),
            "peak_kind": "cuda_max_memory_allocated" if cuda_peak else "cache_bytes_held",
            "prefill_s": pre,
            "decode_ms_median": med * 1e3,
            "decode_ms_mean": mean * 1e3,
            "decode_tok_s": batch / med if med > 0 else None,
            "decode_steps": args.decode_steps,
        }
        if m.label in max_batch:
            row["max_batch"] = max_batch[m.label]
        rows.append(row)
    base = next(r for r in rows if r["method"] == "dynamic")
    for row in rows:
        row["memory_ratio"] = row["kv_bytes"] / base["kv_bytes"]
        row["compression"] = base["kv_bytes"] / row["kv_bytes"] if row["kv_bytes"] else None
        row["peak_ratio"] = row["peak_bytes"] / base["peak_bytes"] if base["peak_bytes"] else None
        row["prefill_speedup"] = base["prefill_s"] / row["prefill_s"] if row["prefill_s"] > 0 else None
        row["decode_speedup_median"] = base["decode_ms_median"] / row["decode_ms_median"]
        row["decode_speedup_mean"] = base["decode_ms_mean"] / row["decode_ms_mean"]
    return rows


# --------------------------------------------------------------------------------------- files, plots
CSV_FIELDS = (
    "method kind preset budget threads quiet context batch kv_bytes memory_ratio compression peak_bytes peak_ratio "
    "peak_kind prefill_s prefill_speedup decode_ms_median decode_ms_mean decode_speedup_median decode_speedup_mean "
    "decode_tok_s max_batch"
).split()


def write_csv(path: str, rows: list[dict[str, Any]]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})
    write_atomic(path, buf.getvalue())


def plot(result: dict[str, Any], path: str) -> None:
    """Decode speed-up and memory ratio vs context, one line per method (and batch size, thread count).

    Speed comes only from groups timed on a quiet machine (:func:`hfkv.evaluation.quiet.verdict`); when
    there are none the figure shows memory alone."""
    import matplotlib  # optional: the [eval] extra (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: the [eval] extra (matplotlib)

    def rows_of(groups):
        return [{**r, "threads": g.get("threads")} for g in groups for r in g["rows"]]

    rows = rows_of(result["groups"])
    timed = rows_of([g for g in result["groups"] if verdict(g.get("quiet")) is None])
    methods = sorted({r["method"] for r in rows}, key=lambda m: (m != "dynamic", m))
    batches = sorted({r["batch"] for r in rows})
    threads = sorted({r["threads"] or 0 for r in timed})
    cmap = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    colors = {m: cmap(i % cmap.N) for i, m in enumerate(methods)}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(10 if timed else 5.5, 4), squeeze=False)
    axes = list(axes[0])

    def style(label: str, batch: int, n: int = 0) -> dict[str, Any]:
        ls = styles[(batches.index(batch) + (threads.index(n) if n in threads else 0)) % len(styles)]
        return dict(marker="o", color=colors[label], ls=ls)

    for (label, batch, n), pts in sorted(_series(timed).items()):
        name = label if len(batches) == 1 else f"{label} (batch {batch})"
        name += f", {n} thread{'s' if n != 1 else ''}" if len(threads) > 1 else ""
        speed = [r["decode_speedup_median"] for r in pts]
        axes[0].plot([r["context"] for r in pts], speed, label=name, **style(label, batch, n))
    memory: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for r in rows:  # bytes do not depend on the thread count: one line per method and batch
        memory.setdefault((r["method"], r["batch"]), {}).setdefault(r["context"], r)
    for (label, batch), by_context in sorted(memory.items()):
        pts = [by_context[c] for c in sorted(by_context)]
        name = label if len(batches) == 1 else f"{label} (batch {batch})"
        axes[-1].plot([r["context"] for r in pts], [r["memory_ratio"] for r in pts], label=name, **style(label, batch))
    titles = ["KV memory / DynamicCache"]
    if timed:
        titles.insert(0, "decode speed-up vs DynamicCache (median step)")
    contexts = sorted({r["context"] for r in rows})
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context (tokens)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    if timed:
        axes[0].axhline(1.0, color="grey", lw=0.8)
        if len(threads) > 1:
            axes[0].legend(fontsize=7)
    axes[-1].legend(fontsize=8)
    head = f"{result['name']}: {result['model']['description']}"
    title = f"{head} ({result['device']})" if timed else f"{head}\n{result['device']}; no speed: not timed quietly"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def _series(rows: list[dict[str, Any]]) -> dict[tuple[str, int, int], list[dict[str, Any]]]:
    out: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["method"], r["batch"], r.get("threads") or 0), []).append(r)
    return {k: sorted(v, key=lambda r: r["context"]) for k, v in out.items()}


# -------------------------------------------------------------------------------------------- command
def _shape_names() -> list[str]:
    return list(SHAPES)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__
    g = parser.add_argument_group("model (one of)")
    g.add_argument("--model", default="testbed", help="hub id, local directory, 'testbed' (default) or 'smollm2'")
    g.add_argument("--gguf-file", default=None, help="GGUF file inside --model (a directory or hub repo)")
    g.add_argument(
        "--random-like",
        type=ca.one_of(_shape_names, "shape"),
        default=None,
        help="random-weight model of a named shape (see --list-shapes)",
    )
    g.add_argument("--random-layers", type=ca.integer(1), default=None, help="with --random-like: keep only N layers")
    g.add_argument("--list-shapes", action="store_true", help="print the known architecture shapes and exit")
    c = parser.add_argument_group("what to measure")
    c.add_argument(
        "--methods",
        nargs="+",
        type=method_specs,
        default=None,
        metavar="SPEC",
        help="method specs, comma- or space-separated: dynamic, static, quanto-int4, "
        f"<preset>[@<budget>][:key=val,...], <file.yaml> (docs/bench.md) (default: {DEFAULT_METHODS})",
    )
    c.add_argument(
        "--budgets",
        type=ca.integer_list(1, allow_none=True, what="budgets", example="256,1024", allow_empty=True),
        default="1024",
        help=f"comma-separated {ca.BUDGETS_TEXT}; every preset given without '@' runs at each; '' runs each "
        "preset at its own (default: %(default)s)",
    )
    c.add_argument(
        "--contexts",
        type=ca.integer_list(1, what="prompt lengths", example="512,2048"),
        default="512,2048",
        help="prompt lengths in tokens (default: %(default)s)",
    )
    c.add_argument(
        "--batch-sizes",
        type=ca.integer_list(1, what="batch sizes", example="1,4"),
        default="1",
        help="batch sizes (default: %(default)s)",
    )
    c.add_argument("--decode-steps", type=ca.integer(1), default=32, help="timed decode steps per cache (default 32)")
    c.add_argument("--warmup", type=ca.integer(0), default=2, help="untimed decode steps first (default 2)")
    c.add_argument(
        "--prefill-repeats", type=ca.integer(1), default=1, help="timed prefills per cache (median; default 1)"
    )
    c.add_argument("--prefill-chunk", type=ca.integer(0), default=0, help="prefill chunk in tokens (0: one forward)")
    c.add_argument(
        "--max-batch-context",
        type=ca.integer(0),
        default=0,
        help="CUDA: also search the largest batch that fits at this context, one of --contexts (0: no search)",
    )
    c.add_argument(
        "--max-batch", type=ca.integer(1), default=256, help="upper end of the largest-batch search (default 256)"
    )
    r = parser.add_argument_group("run")
    r.add_argument("--dtype", type=ca.dtype(), default="bf16", help="model dtype: bf16 (default), fp16, fp32, auto")
    r.add_argument(
        "--device", type=ca.device(), default=None, help="torch device (default: cuda if available, else cpu)"
    )
    quiet.add_arguments(r, default_threads=None)
    r.add_argument(
        "--seed", type=int, default=0, help="seed of the --random-like model's weights (default 0; prompts are fixed)"
    )
    r.add_argument(
        "--sdpa",
        default=BASELINE_SDPA,
        help="torch SDPA backends every forward may use, by priority, or 'default' (torch's choice: on an H200 cuDNN, "
        "which plans every new key length on the host, ~1.3 ms a layer a decode step; default: %(default)s)",
    )
    r.add_argument("--name", default=None, help="result name (default: <model>_<dtype>_<device>)")
    r.add_argument(
        "--out-dir",
        default=DEFAULT_OUT,
        help="where <name>.json/.csv/.png go (default: %(default)s under the working directory; the committed "
        f"results are in {RESULTS_DIR}, regenerated by `make results-bench`)",
    )
    r.add_argument("--force", action="store_true", help="re-measure (context, batch) groups already in the JSON")
    r.add_argument("--no-plot", action="store_true", help="write no .png figure (JSON and CSV only)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_args(args) -> tuple[list, list[tuple[str, str]]]:
    """``(methods, skipped)`` of a checked command line, ``dynamic`` first; :class:`hfkv.cli_args.UsageError`
    on a bad one (a spec no budget of ``--budgets`` makes valid, a model that cannot load...). Loads nothing."""

    def listed(value, parse):  # parsed by add_arguments' types, or a string from a caller of run()
        return parse(value) if isinstance(value, str) else list(value)

    args.contexts = listed(args.contexts, ca.integer_list(1, what="prompt lengths"))
    args.batch_sizes = listed(args.batch_sizes, ca.integer_list(1, what="batch sizes"))
    if args.threads is None:  # on CUDA the CPU threads hardly matter: one pass
        on_cuda = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda"
        args.threads = "all" if on_cuda else "1,all"
    try:
        args.threads = parse_threads(args.threads)
    except ValueError as exc:
        raise ca.UsageError("--threads", str(exc)) from None
    if not args.max_load > 0:
        raise ca.UsageError("--max-load", f"{args.max_load!r} must be a positive number")
    if not args.wait_quiet >= 0:
        raise ca.UsageError("--wait-quiet", f"{args.wait_quiet!r} must be >= 0 seconds")
    budgets = [parse_budget(b) for b in listed(args.budgets, ca.integer_list(1, allow_none=True, allow_empty=True))]
    args.methods = list(args.methods or [DEFAULT_METHODS])
    methods, skipped = [], []
    try:
        for spec in split_specs(args.methods):
            ms, sk = expand_methods(spec, budgets)
            if not ms:
                others = " (and at every other budget of --budgets)" if len(sk) > 1 else ""
                raise ValueError(f"{sk[0][1]}{others}")
            methods += [m for m in ms if m.label not in {x.label for x in methods}]
            skipped += sk
    except (ValueError, FileNotFoundError) as exc:
        raise ca.UsageError("--methods", str(exc)) from None
    if "dynamic" not in [m.label for m in methods]:
        methods = [*expand_methods("dynamic")[0], *methods]
    methods = sorted(methods, key=lambda m: m.label != "dynamic")  # dynamic first: the reference
    if args.random_like:
        try:
            get_shape(args.random_like)
        except ValueError as exc:
            raise ca.UsageError("--random-like", str(exc)) from None
    else:
        if args.random_layers is not None:
            raise ca.UsageError("--random-layers", "only applies with --random-like")
        ca.check_model("--model", args.model, args.gguf_file)
    if args.max_batch_context:
        if args.max_batch_context not in args.contexts:
            raise ca.UsageError(
                "--max-batch-context", f"{args.max_batch_context} is not one of --contexts {args.contexts}"
            )
        if torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).type != "cuda":
            raise ca.UsageError("--max-batch-context", "the largest-batch search needs a CUDA device")
    return methods, skipped


def load_bench_model(args, max_positions: int):
    """(model, description) from --random-like or --model / --gguf-file."""
    from hfkv.loading import load_model, parse_dtype  # deferred: tests patch hfkv.loading.load_model

    dtype = parse_dtype(args.dtype)
    if args.random_like:
        shape = get_shape(args.random_like)
        model = build_random_like(args.random_like, args.random_layers, dtype, args.device, max_positions, args.seed)
        layers = args.random_layers or shape.layers
        desc = f"random {args.random_like} shape ({layers} layers, {shape.kv_heads} KV heads x {shape.dim})"
        return model, {"random_like": args.random_like, "layers": layers, "description": desc}
    model, _ = load_model(args.model, gguf_file=args.gguf_file, dtype=args.dtype, device=args.device)
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit and max_positions > limit:
        print(f"warning: contexts up to {max_positions} exceed max_position_embeddings={limit}", file=sys.stderr)
    return model, {"model": args.model, "gguf_file": args.gguf_file, "description": args.model}


def _group_key(group: dict[str, Any]) -> tuple:
    return group.get("threads"), group["context"], group["batch"]


def _group_sort(group: dict[str, Any]) -> tuple:
    return group.get("threads") or 0, group["context"], group["batch"]


def run(args) -> int:
    """``hfkv bench``: every forward with torch's SDPA limited to ``--sdpa`` (:func:`sdpa_backends`)."""
    try:
        backends = sdpa_backends(args.sdpa)
    except ValueError as exc:
        raise ca.UsageError("--sdpa", str(exc)) from None
    with backends:
        return _run(args)


def _run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    if args.list_shapes:
        for name, s in SHAPES.items():
            print(
                f"{name:<14} {s.model_type:<8} layers={s.layers} hidden={s.hidden} heads={s.heads} "
                f"kv_heads={s.kv_heads} head_dim={s.dim} vocab={s.vocab}"
            )
        return 0
    methods, skipped = check_args(args)  # before anything is loaded
    contexts, batches, threads = args.contexts, args.batch_sizes, args.threads
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    git_commit()  # the commit of the code imported now
    for spec, why in skipped:
        print(f"skipping {spec}: {why}", file=sys.stderr)

    tag = args.random_like or os.path.basename(args.model.rstrip("/"))
    name = args.name or f"{tag}_{args.dtype}_{torch.device(args.device).type}"
    json_path = os.path.join(args.out_dir, f"{name}.json")
    result: dict[str, Any] = {"groups": []}
    if os.path.exists(json_path):
        with open(json_path, encoding="utf-8") as fh:
            result = json.load(fh)
    legacy = result.get("args", {}).get("threads")  # files from before --threads took a list: one count
    for g in result.get("groups", []):
        g.setdefault("threads", legacy if isinstance(legacy, int) else None)
    labels = {m.label for m in methods}
    done = {_group_key(g) for g in result.get("groups", []) if labels <= {r["method"] for r in g["rows"]}}
    todo = [(n, c, b) for n in threads for c in contexts for b in batches if args.force or (n, c, b) not in done]
    record = None
    if todo:  # before the model is built: the load of other processes only
        record = quiet.start(threads, args.max_load, args.wait_quiet, args.force_busy)
        if record["busy"]:
            print(f"warning: busy machine ({quiet.describe(record)}); the result is marked busy", file=sys.stderr)
    max_pos = max(contexts) + args.warmup + args.decode_steps + 8
    model, model_info = load_bench_model(args, max(max_pos, 4096))
    device = machine_name(args.device)
    if device.endswith("torch thread(s)"):  # the thread count is per group
        device = device.rsplit(", ", 1)[0]
    result.update(
        {
            "name": name,
            "device": device,
            "model": model_info,
            "dtype": args.dtype,
            "args": {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"},
            **provenance(),
        }
    )
    per_group = len(methods) * (args.prefill_repeats + args.warmup + args.decode_steps)
    bar = tqdm(total=per_group * len(todo), desc=f"bench {name}", disable=args.no_progress)
    torch_threads = torch.get_num_threads()

    def save() -> None:
        result["busy"] = any((g.get("quiet") or {}).get("busy") for g in result["groups"])
        write_atomic(json_path, json.dumps(json_safe(result), indent=1, sort_keys=True) + "\n")

    try:
        for n, context, batch in todo:
            torch.set_num_threads(n)
            bar.set_postfix_str(f"threads {n} context {context} batch {batch}")
            t0 = time.perf_counter()
            rows = bench_group(model, methods, context, batch, args, bar)
            for r in rows:
                r["threads"] = n
            groups = [g for g in result["groups"] if _group_key(g) != (n, context, batch)]
            wall = round(time.perf_counter() - t0, 2)
            groups.append({"threads": n, "context": context, "batch": batch, "rows": rows, "wall_s": wall})
            groups[-1]["quiet"] = record  # completed by quiet.finish once the last group is timed
            result["groups"] = sorted(groups, key=_group_sort)
            save()
            for r in rows:
                tqdm.write(
                    f"threads {n:>2} context {context:>6} batch {batch:>3} {r['method']:<14} "
                    f"kv={r['kv_bytes'] / 2**20:9.2f} MiB ({r['compression']:.2f}x) prefill={r['prefill_s']:.3f}s "
                    f"({r['prefill_speedup']:.2f}x) decode={r['decode_ms_median']:.2f} ms/step "
                    f"({r['decode_speedup_median']:.2f}x median, {r['decode_speedup_mean']:.2f}x mean)"
                    + (f" max_batch={r['max_batch']}" if "max_batch" in r else "")
                )
    finally:
        torch.set_num_threads(torch_threads)
    if record is not None:
        bar.set_postfix_str("waiting for the run's own load to decay")
        quiet.finish(record)
        result["quiet"] = record
        if record["busy"]:
            tqdm.write(f"busy machine ({quiet.describe(record)}): the result is marked busy, not a result")
    bar.close()
    if not result["groups"]:
        raise SystemExit("nothing measured")
    rows = [
        {**r, "threads": g.get("threads"), "quiet": quiet.verdict(g.get("quiet")) is None}
        for g in result["groups"]
        for r in g["rows"]
    ]
    save()
    write_csv(os.path.join(args.out_dir, f"{name}.csv"), rows)
    if not args.no_plot:
        plot(result, os.path.join(args.out_dir, f"{name}.png"))
    print(f"wrote {json_path} (+ .csv{'' if args.no_plot else ', .png'})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hfkv.evaluation.bench ...`` = ``hfkv bench ...`` (same checks and errors)."""
    return ca.command_main("bench", add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
