"""The GPU check's end-to-end part (eval/gpu/check.py): DynamicCache, hfkv at two budgets and QuantizedCache on a
random Llama-3.1-8B.

The model is built from Llama-3.1-8B's config with random weights in bf16 (no download; step times
and bytes depend on shapes only). For each (context, batch) every cache runs alone, one after the
other, on the same random prompt (after one untimed run of each on a one-row prompt, so no timed prefill
compiles kernels): one prefill forward (timed), ``warmup`` untimed decode steps (and
more, up to 64, until hfkv's first policy run: it compiles kernels once), then ``steps`` decode steps
timed one by one, each between two device synchronisations (its host and device time, as ``generate``
sees a step; bench.Clock says why not events), so the median is a step between policy runs and the mean
includes them. Then DynamicCache and the hfkv caches, kept alive (hfkv's run first, DynamicCache last,
so a kept cache never crowds a prefill), step in turns (``--e2e-interleave`` steps each, from where
each left off): only steps taken in turns see the same host, so the ``*_interleaved`` ratios hold where
a lent machine's host moves (the same DynamicCache step took 23 and 32 ms a minute apart in run 13). Every
forward runs with SDPA limited to ``--e2e-sdpa`` (flash, efficient, math): left to torch, an H200 picks
cuDNN attention, which plans every new key length on the host (~1.3 ms a layer), so DynamicCache's step
depended on whether an earlier cache had stepped through the same lengths (runs 1-12, withdrawn).
Each cache's peak is its own:
``torch.cuda.max_memory_allocated`` above what was allocated before it (the weights and the caches
kept for the turns), over its prefill and decode. A one-forward prefill that runs out
of memory is retried in chunks for DynamicCache and QuantizedCache (recorded as ``prefill_chunk``);
hfkv's chunk path serves short chunks only (docs/kernels.md), so its prefill is always one forward.

The largest batch at the longest context is predicted from the two peaks measured there (peak is
linear in the batch: weights and kernels' fixed costs, then cache and activations per row) and,
where the time left allows, confirmed by one real prefill and two decode steps at that batch.
On a CPU (``--dry-run``) the same code runs a one-layer toy model, peaks are the bytes the cache
held, and there is no batch search.
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from eval.gpu.report import error_text
from hfkv.kernels.compiles import compiled_kernels

GPU_MODEL, CPU_MODEL = "llama-3.1-8b", "cpu-small"
WARMUP_POLICY_STEPS = 64  # at most this many more warm-up steps, waiting for the first policy run
HEADROOM = 0.95  # of the free memory a predicted batch may plan to use
INTERLEAVED_KINDS = ("dynamic", "tristate")  # kept alive for the interleaved steps (QuantizedCache is ~3x slower)
GRAPHED = " graphed"  # the label suffix of an hfkv cache's rows whose steps replay CUDA graphs (hfkv.graphs)


def policy_run_counts(cache) -> tuple[int, int]:
    """A TriStateCache's policy runs so far, over its layers, and how many were finished from a plan prepared a step
    ahead (``TriStateLayer.runs_ahead``): the two tell whether a row's runs took the read-ahead path. (0, 0) for other
    caches."""
    layers = [layer for layer in getattr(cache, "layers", ()) if hasattr(layer, "runs_ahead")]
    return sum(layer.policy_runs for layer in layers), sum(layer.runs_ahead for layer in layers)


def graphed_label(label: str, mode: str | None) -> str:
    """A row's label: the cache's, then for a GraphedDecoder row `` graphed`` (mode "layers") or `` graphed-steps``."""
    if mode is None:
        return label
    return label + GRAPHED + ("" if mode == "layers" else f"-{mode}")


def cache_label(row_label: str) -> str:
    """The cache's label of a row (:func:`graphed_label` undone)."""
    return row_label.split(GRAPHED)[0]


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """quanto's ``unpack`` in torch ops (its own Python fallback, which its module does not export)."""
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (bits * i)) & mask for i in range(8 // bits)]).to(torch.uint8)


def quantized_backend(build_extensions: bool) -> tuple[bool, str]:
    """Whether transformers' QuantizedCache (quanto backend) can run here, and how.

    quanto compiles its CUDA extension (AWQ and Marlin GEMMs beside ``unpack``) on first use, which
    takes minutes of nvcc; the KV cache only needs ``unpack``, so unless ``build_extensions`` the
    extensions not loaded yet get quanto's Python unpack instead (slower than the compiled one, so
    QuantizedCache's step times are an upper bound; the JSON says so).
    """
    if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.quanto") is None:
        return False, "optimum-quanto is not installed (QuantizedCache's quanto backend needs it; docs/kernels.md)"
    try:
        import optimum.quanto  # noqa: F401
        from optimum.quanto.library.extensions import extension
    except Exception as exc:  # noqa: BLE001 - any import failure means: no QuantizedCache here
        return False, f"optimum.quanto did not import: {error_text(exc)}"
    if build_extensions:
        return True, "quanto's compiled extensions, built on first use"
    stood_in = [name for name, ext in extension._extensions.items() if ext._lib is None]
    for name in stood_in:
        extension._extensions[name]._lib = SimpleNamespace(unpack=_unpack)
    return True, (
        f"quanto's Python unpack stands in for its compiled extensions ({', '.join(stood_in) or 'none'}): "
        "QuantizedCache step times are an upper bound (--quanto-cuda-extension builds them)"
    )


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()


def run_cache(
    model,
    method,
    ids: torch.Tensor,
    steps: int,
    warmup: int,
    chunk: int,
    keep: bool = False,
    extra: int = 0,
    graphed: str | None = None,
) -> tuple[dict[str, Any], SimpleNamespace | None]:
    """One cache alone: prefill time, decode step times (median, mean, p20, p80), bytes, peak.

    With ``keep`` a cache that ran is handed back alive (``cache``, next ``tok`` and its ``position``)
    for the interleaved steps, with room for ``extra`` more tokens. With ``graphed`` (a GraphedDecoder mode; a
    TriStateCache on CUDA) the decode steps go through :class:`hfkv.graphs.GraphedDecoder` in that mode, and
    replay CUDA graphs (the row's ``graph_counts``: eager, captured, replayed steps, graphs reused)."""
    from hfkv.evaluation.bench import Clock, decode_step, fill_cache
    from hfkv.evaluation.methods import kv_and_dense_bytes
    from hfkv.storage.memory import cache_bytes

    batch, context = ids.shape
    cuda = ids.device.type == "cuda"
    label = graphed_label(method.label, graphed)
    row: dict[str, Any] = {"method": label, "kind": method.kind, "context": context, "batch": batch}
    cache, live = None, None
    try:
        _free(cuda)
        base = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        prefill_chunk, tok = 0, None
        while tok is None:
            cache = method.make_cache(model, max_cache_len=context + warmup + WARMUP_POLICY_STEPS + steps + extra + 1)
            try:
                t0 = time.perf_counter()
                tok = fill_cache(model, cache, ids, prefill_chunk)
                if cuda:
                    torch.cuda.synchronize()
                row["prefill_s"] = time.perf_counter() - t0
            except torch.OutOfMemoryError:
                if prefill_chunk or method.kind == "tristate" or not 0 < chunk < context:
                    raise
                prefill_chunk = chunk
                row["prefill_note"] = f"one forward ran out of memory; prefilled in chunks of {chunk}"
            if tok is None:  # out of the handler, whose traceback held the failed forward's tensors
                cache = None
                _free(cuda)
                torch.cuda.reset_peak_memory_stats()
        row["prefill_chunk"] = prefill_chunk
        held = [cache_bytes(cache)]
        if graphed:
            from hfkv.graphs import GraphedDecoder

            decoder = GraphedDecoder(model, cache, mode=graphed)
            step = decoder.step
        else:
            decoder = None

            def step(tok, position):
                return decode_step(model, cache, tok, position)

        # Warm-up lasts until a policy run has happened too: its first run compiles the encode and move
        # kernels (seconds, once per process and shape), which is no step's cost.
        layer0 = getattr(cache, "layers", [None])[0]
        policy_seen = not hasattr(layer0, "steps_since_policy")
        i = 0
        while i < warmup or (not policy_seen and i < warmup + WARMUP_POLICY_STEPS):
            tok = step(tok, context + i)
            policy_seen = policy_seen or layer0.steps_since_policy == 0
            i += 1
        row["warmup_steps"] = i
        runs_before = policy_run_counts(cache)
        clock, times, compiled = Clock(ids.device, synced=True), [], 0
        for j in range(i, i + steps):
            before = compiled_kernels()
            t = clock.start()
            tok = step(tok, context + j)
            clock.stop(t, times)
            compiled += compiled_kernels() > before
            if not cuda:
                held.append(cache_bytes(cache))
        clock.resolve()
        row["steps_that_compiled"] = compiled  # a kernel instance compiled inside them (seconds on a GPU, once)
        runs = [b - a for a, b in zip(runs_before, policy_run_counts(cache), strict=True)]
        if runs[0]:  # a TriStateCache's layers' runs in the timed steps, and those finished from a prepared plan
            row["policy_runs"], row["runs_ahead"] = runs
        if decoder is not None:
            row["graph_counts"] = dict(decoder.counts)
        med = statistics.median(times)
        row |= {
            "decode_ms_median": 1e3 * med,
            "decode_ms_mean": 1e3 * statistics.fmean(times),
            "decode_ms_p20": 1e3 * _quantile(times, 0.2),
            "decode_ms_p80": 1e3 * _quantile(times, 0.8),
            "decode_steps": steps,
            "decode_tok_s": batch / med if med > 0 else None,
        }
        kv, dense = kv_and_dense_bytes(model, cache, batch)
        row |= {"kv_bytes": kv, "dense_bytes": dense, "compression": dense / kv if kv else None}
        row["peak_bytes"] = int(torch.cuda.max_memory_allocated() - base) if cuda else int(max(held))
        row["peak_kind"] = "cuda_max_memory_allocated_above_weights" if cuda else "cache_bytes_held"
        row["backend"] = getattr(cache, "backend", "transformers")
        row["status"] = "ok"
        if keep:
            live = SimpleNamespace(cache=cache, tok=tok, position=context + i + steps)
    except torch.OutOfMemoryError as exc:
        row |= {"status": "oom", "reason": error_text(exc)}
    except Exception as exc:  # noqa: BLE001 - a cache that fails is a result
        row |= {"status": "error", "reason": error_text(exc)}
    finally:
        cache = None
        _free(cuda)
    return row, live


def interleave(model, rows: list[dict[str, Any]], lives: dict[str, SimpleNamespace], steps: int) -> None:
    """Step the kept caches in turns, ``steps`` each, and add each one's ``interleaved`` times to its row.

    A lent machine's host moves (run 13: DynamicCache's step at 8k x 8 took 32 ms alone and 23 ms in
    turns a minute later), and each cache alone sees its own stretch of it; stepping them in turns shows
    every cache the same host, so the ratios (``decode_speedup_*_interleaved``) hold where absolute times
    move. The caches go on from where
    their own steps left them, policy runs included (every ``interval`` steps of each).
    """
    from hfkv.evaluation.bench import Clock, interleaved_decode

    caches = {name: lv.cache for name, lv in lives.items()}
    tokens = {name: lv.tok for name, lv in lives.items()}
    starts = {name: lv.position for name, lv in lives.items()}
    times = interleaved_decode(model, caches, tokens, starts, steps, warmup=0, clock=Clock(model.device, synced=True))
    by_name = {r["method"]: r for r in rows}
    for name, ts in times.items():
        by_name[name]["interleaved"] = {
            "steps": len(ts),
            "with": sorted(lives),
            "decode_ms_median": 1e3 * statistics.median(ts),
            "decode_ms_mean": 1e3 * statistics.fmean(ts),
        }


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's speed and memory against DynamicCache's row of the same (context, batch)."""
    base = {(r["context"], r["batch"]): r for r in rows if r["method"] == "dynamic" and r.get("status") == "ok"}
    for r in rows:
        b = base.get((r["context"], r["batch"]))
        if r.get("status") != "ok" or b is None:
            continue
        r["decode_speedup_median"] = b["decode_ms_median"] / r["decode_ms_median"]
        r["decode_speedup_mean"] = b["decode_ms_mean"] / r["decode_ms_mean"]
        if "interleaved" in r and "interleaved" in b:
            mine, base_i = r["interleaved"], b["interleaved"]
            r["decode_speedup_median_interleaved"] = base_i["decode_ms_median"] / mine["decode_ms_median"]
            r["decode_speedup_mean_interleaved"] = base_i["decode_ms_mean"] / mine["decode_ms_mean"]
        r["prefill_speedup"] = b["prefill_s"] / r["prefill_s"] if r["prefill_s"] else None
        r["peak_ratio"] = r["peak_bytes"] / b["peak_bytes"] if b["peak_bytes"] else None
        r["kv_ratio"] = r["kv_bytes"] / b["kv_bytes"] if b["kv_bytes"] else None


def predict_max_batch(points: list[tuple[int, int]], free_bytes: int) -> dict[str, Any]:
    """Largest batch whose peak fits ``HEADROOM`` of ``free_bytes``, linear through the (batch, peak) ends."""
    (b1, p1), (b2, p2) = points[0], points[-1]
    slope = (p2 - p1) / (b2 - b1)
    fixed = p1 - slope * b1
    out: dict[str, Any] = {"per_row_bytes": int(slope), "fixed_bytes": int(fixed), "free_bytes": int(free_bytes)}
    out["basis"] = f"peaks at batch {b1} and {b2}, linear in the batch; {HEADROOM:.0%} of the free memory"
    out["predicted"] = int((free_bytes * HEADROOM - fixed) // slope) if slope > 0 else None
    return out


def largest_batches(model, methods, rows, context: int, budget, cuda: bool) -> dict[str, Any]:
    if not cuda:
        budget.skip("e2e", "largest batch", "needs a CUDA device: a CPU has no memory limit to find")
        return {}
    from hfkv.evaluation.bench import cuda_fits

    _free(True)
    free = torch.cuda.mem_get_info()[0]
    out: dict[str, Any] = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m.label and r["context"] == context and r.get("status") == "ok"]
        pts = sorted({(r["batch"], r["peak_bytes"]) for r in mine})
        if len(pts) < 2:
            out[m.label] = {"context": context, "predicted": None, "reason": "needs peaks at two batch sizes here"}
            continue
        entry = {"context": context, **predict_max_batch(pts, free), "confirmed": None}
        pred, rate = entry["predicted"], max(r["context"] * r["batch"] / r["prefill_s"] for r in mine)
        chunk = max(r.get("prefill_chunk", 0) for r in mine)
        need = 15 + 1.5 * context * (pred or 0) / rate
        if pred and pred >= 1 and budget.allows("e2e", f"largest batch of {m.label}: one trial", need):
            try:
                entry["confirmed"] = cuda_fits(model, m, context, 2, chunk)(pred)
            except Exception as exc:  # noqa: BLE001
                entry["confirm_error"] = error_text(exc)
        out[m.label] = entry
    return out


def graph_capture(model, method, ids: torch.Tensor, steps: int) -> dict[str, Any]:
    """Capture one decode step of ``method``'s cache in a CUDA graph, replay it, and compare with the same step
    run eagerly on a twin cache (same prompt, same steps before it).

    Between two policy runs the step's shapes, grids and pointers are fixed, so the capture records the
    whole step; the host-side counters (window slot, length) advance once, during the capture, so one
    replay is that step. (Replaying one graph across steps would need those counters on the device.)
    """
    from hfkv.evaluation.bench import decode_step, fill_cache

    row: dict[str, Any] = {"method": method.label, "context": ids.shape[1], "batch": ids.shape[0]}
    if ids.device.type != "cuda":
        return row | {"status": "skipped", "reason": "CUDA graphs need a CUDA device"}
    try:
        caches, toks = [], []
        for _ in range(2):
            cache = method.make_cache(model)
            tok = fill_cache(model, cache, ids)
            pos = ids.shape[1]
            for i in range(steps):  # to just after a policy run, so the captured step is between two
                tok = decode_step(model, cache, tok, pos + i)
                if getattr(cache.layers[0], "steps_since_policy", 0) == 0:
                    break
            caches.append(cache)
            toks.append(tok)
        pos_ids = torch.full((ids.shape[0], 1), pos + i + 1, dtype=torch.long, device=ids.device)
        with torch.inference_mode():
            eager = model(input_ids=toks[0], position_ids=pos_ids, past_key_values=caches[0]).logits
            graph, static_tok = torch.cuda.CUDAGraph(), toks[1].clone()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                captured = model(input_ids=static_tok, position_ids=pos_ids, past_key_values=caches[1]).logits
            graph.replay()
            torch.cuda.synchronize()
        diff = float((captured.float() - eager.float()).abs().max())
        same = bool(torch.equal(captured.argmax(-1), eager.argmax(-1)))
        return row | {"status": "ok" if same and diff < 1e-2 else "mismatch", "max_abs_diff": diff, "same_argmax": same}
    except Exception as exc:  # noqa: BLE001 - a step that cannot be captured is a result
        return row | {"status": "error", "reason": error_text(exc)}


def run_e2e(args, budget, device: str, out: dict[str, Any], save: Callable[[], None]) -> dict[str, Any]:
    """The e2e part of the GPU check (module docstring), filling ``out``: rows per (context, batch, cache),
    largest batches; ``save()`` after each row, so a run stopped from outside keeps them. Every forward
    runs with torch's SDPA limited to ``--e2e-sdpa`` (``bench.sdpa_backends``)."""
    from hfkv.evaluation.bench import sdpa_backends

    out["sdpa_backends"] = args.e2e_sdpa
    with sdpa_backends(args.e2e_sdpa):
        return _run_e2e(args, budget, device, out, save)


def _run_e2e(args, budget, device: str, out: dict[str, Any], save: Callable[[], None]) -> dict[str, Any]:
    from hfkv.evaluation.bench import random_prompt
    from hfkv.evaluation.methods import parse_method
    from hfkv.evaluation.shapes import build_random_like, get_shape

    cuda = device == "cuda"
    name = GPU_MODEL if cuda else CPU_MODEL
    shape = get_shape(name)
    layers = shape.layers if cuda else 1
    dtype = torch.bfloat16 if cuda else torch.float32
    out |= {"rows": [], "max_batch": {}}
    methods = [parse_method("dynamic")] + [parse_method(f"hfkv@{b}:backend=triton") for b in args.budgets]
    methods += extra_methods(args.e2e_extra)
    ok, note = quantized_backend(args.quanto_cuda_extension)
    out["quantized_cache"] = {"available": ok, "note": note}
    if ok:
        methods.append(parse_method("quanto-int4"))
    else:
        budget.skip("e2e", "QuantizedCache", note)
    if args.e2e_graphs and not cuda:
        budget.skip("e2e", "graphed hfkv rows", "CUDA graphs need a CUDA device")
    if not budget.allows("e2e", "model", 40.0 if cuda else 5.0):
        return out
    t0 = time.perf_counter()
    max_pos = max(4096, max(args.e2e_contexts) + args.e2e_warmup + WARMUP_POLICY_STEPS + args.e2e_steps + 64)
    max_pos += args.e2e_interleave
    model = build_random_like(name, layers, dtype, device, max_pos)
    out["model"] = {
        "shape": name,
        "layers": layers,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.dim,
        "dtype": str(dtype).replace("torch.", ""),
        "weights_bytes": int(sum(p.numel() * p.element_size() for p in model.parameters())),
        "build_s": round(time.perf_counter() - t0, 1),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }
    warm_up(model, methods, min(args.e2e_contexts), args.e2e_chunk, budget, out)
    rates: dict[str, float] = {}  # prefill tokens per second of each cache, measured
    steps_s: dict[str, float] = {}  # decode step seconds per cache, measured
    n_steps = args.e2e_warmup + args.e2e_steps
    for context in args.e2e_contexts:
        for batch in args.e2e_batches:
            ids = random_prompt(model.config.vocab_size, batch, context).to(device)
            group, lives, tried = [], {}, set()

            def need_s(m, context=context, batch=batch) -> float:  # its rate so far, else the slowest, else a guess
                rate = rates.get(m.label) or min(rates.values(), default=8000.0 if cuda else 300.0)
                step = steps_s.get(m.label, 0.15 if cuda else 1.0)
                return 5 + 1.5 * context * batch / rate + n_steps * step * 1.5

            for m in _kept_last(methods, args.e2e_interleave):
                # an hfkv cache that ran is run again with its steps replayed from CUDA graphs
                graphs = args.e2e_graphs and cuda and m.kind == "tristate"
                ran = False  # the cache's own row ran ok: its graphed rows follow
                for graphed in [None, *(args.e2e_graph_modes if graphs else ())]:
                    if graphed and not ran:
                        continue
                    label = graphed_label(m.label, graphed)
                    reserve = reference_reserve(m, methods, tried, need_s)
                    if not budget.allows("e2e", f"{label} context {context} batch {batch}", need_s(m) + reserve):
                        continue
                    tried.add(m.label)
                    keep = not graphed and args.e2e_interleave > 0 and m.kind in INTERLEAVED_KINDS
                    row, live = run_cache(
                        model, m, ids, args.e2e_steps, args.e2e_warmup, args.e2e_chunk, keep, args.e2e_interleave,
                        graphed,
                    )  # fmt: skip
                    group.append(row)
                    ran = ran or (not graphed and row["status"] == "ok")
                    if live is not None:
                        lives[m.label] = live
                    out["rows"].append(row)
                    save()
                    if row["status"] == "ok" and not graphed:
                        rates[m.label] = min(rates.get(m.label, 1e12), context * batch / max(row["prefill_s"], 1e-6))
                        steps_s[m.label] = max(row["decode_ms_mean"], row["decode_ms_p80"]) / 1e3
                    print(_line(row), flush=True)
            if len(lives) > 1 and budget.allows(
                "e2e", f"interleaved steps at context {context} batch {batch}",
                5 + 1.5 * args.e2e_interleave * sum(steps_s.get(name, 0.15) for name in lives),
            ):  # fmt: skip
                interleave(model, group, lives, args.e2e_interleave)
                save()
            lives = live = None
            _free(cuda)
            if group:  # rows in the methods' order, DynamicCache first, each graphed row after its cache's
                order = {m.label: i for i, m in enumerate(methods)}
                out["rows"][-len(group) :] = sorted(group, key=lambda r: (order[cache_label(r["method"])], r["method"]))
    add_ratios(out["rows"])
    if budget.allows("e2e", "CUDA graph capture of a decode step", 20.0 if cuda else 1.0):
        context = min(args.e2e_contexts)
        ids = random_prompt(model.config.vocab_size, 1, context).to(device)
        out["graph_capture"] = graph_capture(model, methods[1], ids, 16)
        print(f"e2e graph capture: {out['graph_capture']}", flush=True)
        save()
    out["max_batch"] = largest_batches(model, methods, out["rows"], max(args.e2e_contexts), budget, cuda)
    del model
    _free(cuda)
    return out


def extra_methods(specs: list[str]) -> list:
    """``--e2e-extra``'s caches: hfkv's on the Triton backend unless a spec names a backend."""
    from hfkv.evaluation.methods import parse_method, split_specs

    out = []
    for spec in split_specs(specs):
        m = parse_method(spec)
        if m.kind == "tristate" and "backend=" not in spec:
            m = parse_method(spec + (",backend=triton" if ":" in spec else ":backend=triton"))
        out.append(m)
    return out


def warm_up(model, methods, context: int, chunk: int, budget, out: dict[str, Any]) -> None:
    """Each cache once, untimed, on a one-row prompt of ``context`` tokens through its first policy run:
    a process's first prefill compiles hfkv's encode kernels and picks the model's attention kernels
    (seconds, once per process), which the first timed prefill took for its own (run 12: hfkv@1024 at
    8k x 8 3.14 s, hfkv@4096 right after it 2.36 s, DynamicCache 2.27 s)."""
    from hfkv.evaluation.bench import random_prompt

    ids = random_prompt(model.config.vocab_size, 1, context).to(model.device)
    out["warmup"] = {"context": context, "batch": 1, "seconds": {}}
    for m in methods:
        if not budget.allows("e2e", f"warm-up of {m.label}", 30.0 if model.device.type == "cuda" else 2.0):
            return
        t = time.perf_counter()
        run_cache(model, m, ids, 1, 0, chunk)  # nothing kept
        out["warmup"]["seconds"][m.label] = round(time.perf_counter() - t, 2)


def reference_reserve(method, methods: list, tried: set[str], need_s: Callable[[Any], float]) -> float:
    """Seconds a row other than DynamicCache's must leave for DynamicCache's (``need_s`` of it), while that row has not
    been tried at this context and batch (``tried``: labels): it is every ratio's reference and runs last
    (:func:`_kept_last`), so a part that runs short skips the other caches' rows, not the one they are read against
    (the fourteenth lease lost its ratios to that). 0 for DynamicCache itself, once it was tried, or without it."""
    dynamic = next((m for m in methods if m.kind == "dynamic"), None)
    if dynamic is None or method is dynamic or dynamic.label in tried:
        return 0.0
    return need_s(dynamic)


def _kept_last(methods: list, interleave: int) -> list:
    """The order the caches run in: with interleaved steps, the kept caches whose prefill peaks least first
    (hfkv's), DynamicCache last, so the caches held alive for the turns do not crowd a later prefill."""
    if interleave <= 0:
        return list(methods)
    rank = {"tristate": 0, "quantized": 1, "static": 2, "dynamic": 3}
    return sorted(methods, key=lambda m: rank.get(m.kind, 1))


def _line(r: dict[str, Any]) -> str:
    head = f"e2e {r['method']:<24} T={r['context']:>6} B={r['batch']:>2}"
    if r.get("status") != "ok":
        return f"{head} {r.get('status')}: {r.get('reason')}"
    return (
        f"{head} prefill {r['prefill_s']:7.2f} s  step {r['decode_ms_median']:8.2f} ms (mean {r['decode_ms_mean']:.2f})"
        f"  peak {r['peak_bytes'] / 2**30:6.2f} GiB  kv {r['kv_bytes'] / 2**30:6.2f} GiB"
    )
