"""Where a policy run's time goes, on the device it runs on: the section profile of a decode step.

On an H200 (gpu_check run 5, Llama-3.1-8B random, 32k x 8) ``hfkv@1024``'s decode step took 25.7 ms
between policy runs and 68 ms on average: the runs (every ``interval`` = 8 steps) cost ~340 ms each,
~10 ms per layer, far more than the bytes they touch (~2M records' position and score per layer, tens
of MB). This script says where that time is, so the fix is aimed, not guessed:

* each decode step timed alone (synchronised), marked with whether it ran the policy and whether a kernel
  instance compiled inside it (``hfkv.kernels.compiles``; such steps are left out of ``step_ms``);
* one policy run per layer timed alone (``run_policy``, synchronised before and after);
* the step that runs a policy and the one before it (whose attention launches the run's first part, ``run_ahead``)
  under ``torch.profiler`` with hfkv's sections labelled (``run_policy``, ``run_ahead``, ``candidates``
  (within it ``read_meta`` per tier, except on the CPU backend), ``classify``, ``apply``, ``admit``, ``attend``):
  host and device milliseconds per section and policy run (a kernel counted in the sections that launched it),
  each section's largest kernels, kernel launches and host syncs per section, and the top torch ops;
* a prefill (``prefill`` in the JSON; ``--no-prefill`` skips it): one prefill forward of a DynamicCache
  and of the cache, best of two, interleaved after one warm-up each, then the cache's own prefill work
  per layer with each part synchronised before and after (``synced_ms_per_layer``: host gaps included)
  and profiled (``sections``, beside ``dynamic_top_ops``, what the model's own prefill launches).

    python -m eval.policy_profile --out DIR                  # a CUDA machine: Llama-3.1-8B shape, 4 layers, 32k x 8
    python -m eval.policy_profile --out DIR --dry-run        # a CPU: the small shape, in seconds (the suite runs it)

Writes ``DIR/policy_profile.json``. Nothing is asserted: a profile is evidence for a change, and
its numbers come with the device, the shape and the code's commit.

Run from the repository root as ``python -m eval.policy_profile``: it imports of this package (a plain ``python
eval/policy_profile.py`` puts only its own folder on the import path, which does not reach them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from eval.gpu.e2e import policy_run_counts  # noqa: E402
from hfkv.atomic import write_atomic  # noqa: E402
from hfkv.evaluation.bench import decode_step, fill_cache, random_prompt  # noqa: E402
from hfkv.evaluation.methods import parse_method  # noqa: E402
from hfkv.evaluation.results import provenance, script_command  # noqa: E402
from hfkv.evaluation.shapes import build_random_like  # noqa: E402
from hfkv.kernels.compiles import compiled_kernels  # noqa: E402

# Methods of the layer's parts / PagedTiers labelled in the profile: (owner, attribute, section name).
SECTIONS = (
    ("policy", "run", "run_policy"),
    ("policy", "classify", "classify"),
    ("moves", "apply", "apply"),
    ("moves", "apply_planned", "apply"),  # the Triton backend's: the move plan and the movers' gathers
    ("moves", "admit", "admit"),
    ("reads", "attend", "attend"),
    ("policy", "prepare_ahead", "run_ahead"),  # a run's first part, launched after the step before's attention
    ("tiers", "candidates", "candidates"),
    ("tiers", "read_meta", "read_meta"),
    ("tiers", "remove", "remove"),
    ("tiers", "remove_states", "remove"),  # a planned run's removals of every tier (two launches on Triton)
    ("tiers", "append_tokens", "append_tokens"),
)
# A prefill's sections: the forward's attention (``prefill_layer`` less ``admit_prompt``), and what hfkv adds to it.
PREFILL_SECTIONS = (
    ("prefill", "attend_prompt", "prefill_layer"),
    ("prefill", "admit_prompt", "admit_prompt"),
    ("prefill", "observation_probs", "observation_probs"),
    ("prefill", "token_scores", "token_scores"),
    ("prefill", "oq_score", "oq_score"),
    ("prefill", "smooth_scores", "smooth_scores"),  # the Triton path's: pooling and carry of the kernel's sums
    ("observation", "observation_scores", "observation_scores"),
    ("observation", "oq_score_triton", "oq_score_triton"),
    ("window", "push", "window_push"),
    ("policy", "classify", "classify"),
    ("moves", "admit", "admit"),
    ("tiers", "append_tokens", "append_tokens"),
    ("budget", "refresh_peak", "refresh_tier_peak"),
)
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")


@contextmanager
def patched(sections, wrap):
    """Every method (or ``hfkv.layer.prefill`` / ``hfkv.kernels.observation`` function) named in ``sections`` replaced
    by ``wrap(fn, name)`` meanwhile; a method the code at hand lacks (an older commit's) is left out."""
    import hfkv.kernels.observation
    import hfkv.layer.prefill
    from hfkv.layer.budget import Budget
    from hfkv.layer.policy_runner import PolicyRunner
    from hfkv.layer.reads import Reads
    from hfkv.storage.moves import Moves
    from hfkv.storage.paged import PagedTiers
    from hfkv.storage.window import WindowRing

    owners = {"policy": PolicyRunner, "moves": Moves, "reads": Reads, "budget": Budget, "tiers": PagedTiers,
              "window": WindowRing, "prefill": hfkv.layer.prefill, "observation": hfkv.kernels.observation}  # fmt: skip
    functions = ("prefill", "observation")  # module functions, looked up by name where they are called
    saved = []
    for owner, attr, name in sections:
        cls = owners[owner]
        if owner not in functions and attr not in cls.__dict__:
            continue
        fn = getattr(cls, attr) if owner in functions else cls.__dict__[attr]
        saved.append((cls, attr, fn))
        setattr(cls, attr, wrap(fn, name))
    try:
        yield
    finally:
        for cls, attr, fn in saved:
            setattr(cls, attr, fn)


def labelled_sections(sections=SECTIONS):
    """Every method in ``sections`` runs inside ``torch.profiler.record_function("hfkv::<name>")``."""

    def wrap(fn, name):
        def wrapped(*a, **kw):
            with torch.profiler.record_function(f"hfkv::{name}"):
                return fn(*a, **kw)

        return wrapped

    return patched(sections, wrap)


def timed_sections(sections, device: torch.device, totals: dict[str, float]):
    """Every method in ``sections`` synchronised before and after and its wall time added to ``totals`` (ms):
    what each part of a prefill costs the step, host gaps included (a profile's device time leaves them out).
    Nested sections each count their whole time."""

    def wrap(fn, name):
        def wrapped(*a, **kw):
            _sync(device)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                _sync(device)
                totals[name] = totals.get(name, 0.0) + 1e3 * (time.perf_counter() - t)

        return wrapped

    return patched(sections, wrap)


@contextmanager
def timed_launches(totals: dict[str, list[float]], owner=None, sites=None):
    """Every Triton launch (``JITFunction.run``: argument binding, specialization, cache lookup and the driver's
    launch, no waiting) timed on the host meanwhile, its seconds appended to ``totals[kernel name]``. What
    eval/host_overhead.py cannot see on a CPU, where launches are recorded instead of made: on a GPU the launch path
    is most of a policy run's host time (run 12: a run of one layer 2.2-3.0 ms synchronised, 0.14 ms of it on the
    device, against 0.4 ms of hfkv's own Python). A decode plan's launches that take a bound site
    (hfkv.kernels.launch) skip ``JITFunction.run``; they are timed at the site, under ``"<kernel> (bound)"`` (a site's
    call that went through Triton is counted by ``run`` alone). ``owner`` / ``sites``: the classes whose ``run`` /
    ``__call__`` are timed (tests pass stand-ins)."""
    if owner is None:
        from triton.runtime.jit import JITFunction as owner
    if sites is None:
        from hfkv.kernels.launch import KernelLaunch as sites
    run, call = owner.run, sites.__call__

    def name_of(kernel) -> str:
        return getattr(getattr(kernel, "fn", None), "__name__", type(kernel).__name__)

    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            totals.setdefault(name_of(self), []).append(time.perf_counter() - t)

    def timed_site(self, *args):
        before, t = self.bound_launches, time.perf_counter()
        try:
            return call(self, *args)
        finally:
            if self.bound_launches != before:
                totals.setdefault(f"{name_of(self.fn)} (bound)", []).append(time.perf_counter() - t)

    owner.run, sites.__call__ = timed, timed_site
    try:
        yield
    finally:
        owner.run, sites.__call__ = run, call


def launch_table(totals: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per kernel: launches and host microseconds per launch (median and mean), the costliest first."""
    rows = {
        name: {
            "launches": len(xs),
            "us_median": 1e6 * statistics.median(xs),
            "us_mean": 1e6 * statistics.fmean(xs),
            "ms_total": 1e3 * sum(xs),
        }
        for name, xs in totals.items()
        if xs
    }
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["ms_total"]))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def launched_kernels(event) -> dict[str, float]:
    """Device microseconds by kernel name of every kernel launched inside ``event`` (a profiler event: itself and its
    CPU descendants), matched to its launch by the profiler's correlation ids.

    A kernel's own event sits on the device's timeline, so one counted by where its start falls among host ranges
    lands in whatever section the host was in when the device got to it: with the host ahead of the device and a
    wait in ``append_tokens``, that put other sections' kernels there (policy profiles before the thirteenth lease)."""
    out: dict[str, float] = defaultdict(float)
    stack = [event]
    while stack:
        e = stack.pop()
        for k in getattr(e, "kernels", None) or ():
            out[k.name] += k.duration
        stack.extend(getattr(e, "cpu_children", None) or ())
    return dict(out)


def section_table(events, policy_runs: int, top: int = 8) -> dict[str, Any]:
    """Per section: host ms and device ms per policy run (the kernels launched inside it, nested sections
    included), its ``top`` kernels by device time, launches and syncs inside it per policy run."""
    spans = defaultdict(list)  # name -> [(start_us, end_us)] on the host
    kernels: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in events:
        if e.name.startswith("hfkv::"):
            spans[e.name[6:]].append((e.time_range.start, e.time_range.end))
            for name, us in launched_kernels(e).items():
                kernels[e.name[6:]][name] += us
    out: dict[str, Any] = {}
    runs = max(policy_runs, 1)
    for name, ranges in spans.items():
        host_us = sum(b - a for a, b in ranges)
        launches = syncs = 0
        for e in events:
            start = e.time_range.start
            if not any(a <= start <= b for a, b in ranges):
                continue
            if e.name in LAUNCH_EVENTS:
                launches += 1
            elif e.name in SYNC_EVENTS:
                syncs += 1
        by_kernel = sorted(kernels[name].items(), key=lambda kv: -kv[1])
        out[name] = {
            "calls": len(ranges),
            "host_ms_per_policy_run": host_us / 1e3 / runs,
            "device_ms_per_policy_run": sum(us for _, us in by_kernel) / 1e3 / runs,
            "launches_per_policy_run": launches / runs,
            "syncs_per_policy_run": syncs / runs,
            "kernels_ms_per_policy_run": {k: us / 1e3 / runs for k, us in by_kernel[:top]},
        }
    return out


def prefill_profile(model, method, ids: torch.Tensor, device: torch.device, cuda: bool) -> dict[str, Any]:
    """One prefill each of a DynamicCache and of ``method``, timed alone (after one warm-up each), then
    ``method``'s prefill again under the profiler with hfkv's prefill sections labelled (per layer)."""
    from transformers import DynamicCache

    def timed(make) -> float:
        cache = make()
        _sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            fill_cache(model, cache, ids)
        _sync(device)
        return time.perf_counter() - t

    def hfkv_cache():
        return method.make_cache(model, max_cache_len=ids.shape[1] + 256)

    timed(lambda: DynamicCache(config=model.config))
    timed(hfkv_cache)
    times = {"dynamic_s": [], "hfkv_s": []}
    for _ in range(2):  # interleaved
        times["dynamic_s"].append(timed(lambda: DynamicCache(config=model.config)))
        times["hfkv_s"].append(timed(hfkv_cache))
    out: dict[str, Any] = {k: min(v) for k, v in times.items()}
    out["ratio_dynamic_over_hfkv"] = out["dynamic_s"] / out["hfkv_s"]
    totals: dict[str, float] = {}
    with timed_sections(PREFILL_SECTIONS, device, totals):
        out["hfkv_sections_synced_s"] = timed(hfkv_cache)
    layers = len(model.model.layers)
    out["synced_ms_per_layer"] = {k: v / layers for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    cache = hfkv_cache()
    with labelled_sections(PREFILL_SECTIONS), torch.profiler.profile(activities=activities) as prof:
        with torch.inference_mode():
            fill_cache(model, cache, ids)
        _sync(device)
    layers = sum(hasattr(layer, "run_policy") for layer in cache.layers)
    out["sections"] = section_table(prof.events(), policy_runs=layers)
    out["sections_note"] = "per layer's prefill (the *_per_policy_run fields are per layer here)"
    out["top_ops"] = top_ops(prof, n=15)
    with torch.profiler.profile(activities=activities) as prof:  # what the model's own prefill launches
        with torch.inference_mode():
            fill_cache(model, DynamicCache(config=model.config), ids)
        _sync(device)
    out["dynamic_top_ops"] = top_ops(prof, n=15)
    return out


def top_ops(profile, n: int = 25) -> dict[str, list[dict[str, Any]]]:
    rows = [
        {
            "op": a.key,
            "count": a.count,
            "self_cpu_ms": a.self_cpu_time_total / 1e3,
            "self_device_ms": getattr(a, "self_device_time_total", 0.0) / 1e3,
        }
        for a in profile.key_averages()
    ]
    return {
        "by_host": sorted(rows, key=lambda r: -r["self_cpu_ms"])[:n],
        "by_device": sorted(rows, key=lambda r: -r["self_device_ms"])[:n],
    }


def print_sections(sections: dict[str, Any], order: str) -> None:
    for name, s in sorted(sections.items(), key=lambda kv: -kv[1][order]):
        print(
            f"  {name:<18} host {s['host_ms_per_policy_run']:8.2f} ms  device {s['device_ms_per_policy_run']:8.2f} ms"
            f"  launches {s['launches_per_policy_run']:6.1f}  syncs {s['syncs_per_policy_run']:5.1f}"
        )
        top = list(s.get("kernels_ms_per_policy_run", {}).items())[:3]
        if top:
            print("    " + ", ".join(f"{k[:40]} {ms:.3f} ms" for k, ms in top))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="the small shape on the CPU, in seconds")
    ap.add_argument("--method", default="hfkv@1024:backend=triton")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the random model (all alike)")
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed one by one")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill profile")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    if args.dry_run:
        args.context, args.batch, args.layers, args.steps = 256, 2, 1, 10
        args.method = args.method.replace("hfkv@1024", "hfkv@64").replace("backend=triton", "backend=auto")
    shape, dtype = ("llama-3.1-8b", torch.bfloat16) if cuda else ("cpu-small", torch.float32)
    method = parse_method(args.method)
    result: dict[str, Any] = {
        "what": "where a policy run's time goes (eval/policy_profile.py docstring)",
        "command": script_command("eval/policy_profile.py", argv),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "shape": shape,
        "layers": args.layers,
        "context": args.context,
        "batch": args.batch,
        "method": method.label,
        "threads": torch.get_num_threads(),
        **provenance(),
    }
    model = build_random_like(shape, args.layers, dtype, device, args.context + 256)
    ids = random_prompt(model.config.vocab_size, args.batch, args.context).to(device)
    cache = method.make_cache(model, max_cache_len=args.context + 256)
    t0 = time.perf_counter()
    tok = fill_cache(model, cache, ids)
    _sync(device)
    result["prefill_s"] = time.perf_counter() - t0
    layer0 = cache.layers[0]
    interval = layer0.cfg.interval
    pos = args.context
    # Warm up past two policy runs: the first compiles the encode and move kernels.
    runs = 0
    while runs < 2:
        tok = decode_step(model, cache, tok, pos)
        pos += 1
        runs += layer0.steps_since_policy == 0

    # Triton's launch path timed on the host over the timed steps (not on the CPU dry run: its interpreter's launches
    # take another path).
    launches: dict[str, list[float]] = {}
    steps = []
    with timed_launches(launches) if cuda else nullcontext():
        for _ in range(args.steps):
            before, runs_before = compiled_kernels(), policy_run_counts(cache)
            _sync(device)
            t = time.perf_counter()
            tok = decode_step(model, cache, tok, pos)
            _sync(device)
            ms = 1e3 * (time.perf_counter() - t)
            compiled = compiled_kernels() - before  # a step that compiled a kernel instance: no step's cost
            runs, ahead = (b - a for a, b in zip(runs_before, policy_run_counts(cache), strict=True))
            steps.append({"ms": ms, "policy": layer0.steps_since_policy == 0, "compiled": compiled, "runs": runs,
                          "runs_ahead": ahead})  # fmt: skip
            pos += 1
    result["triton_launches"] = launch_table(launches)  # over the timed steps, compiling launches included
    warm = [s for s in steps if not s["compiled"]]
    plain = [s["ms"] for s in warm if not s["policy"]]
    with_policy = [s["ms"] for s in warm if s["policy"]]
    result["steps"] = steps
    result["step_ms"] = {
        "median_without_policy": statistics.median(plain) if plain else None,
        "median_with_policy": statistics.median(with_policy) if with_policy else None,
        "mean": statistics.fmean(s["ms"] for s in warm) if warm else None,
        "interval": interval,
        "steps_that_compiled": len(steps) - len(warm),  # left out of the figures above (in `steps`, marked)
        "policy_runs": sum(s["runs"] for s in steps),  # the layers' runs in the timed steps
        "runs_ahead": sum(s["runs_ahead"] for s in steps),  # of them, finished from a plan prepared a step ahead
    }

    def to_policy_eve(tok, pos, before: int = 1):  # steps until the `before`-th next one runs the policy
        while layer0.steps_since_policy != interval - before:
            tok = decode_step(model, cache, tok, pos)
            pos += 1
        return tok, pos

    # The step that runs the policy profiled, and the one before it: that one's attention queues the run's first
    # part (PolicyRunner.prepare_ahead, section "run_ahead"), the run's step the rest. Profiled before the runs
    # made alone below, which are called off their step and shift the ring's phase (the twelfth H200 profile's
    # interval followed them, and before 497ac5e a run whose exits then wrapped was not prepared ahead).
    profiled = min(2, interval)
    tok, pos = to_policy_eve(tok, pos, before=profiled)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with labelled_sections(), torch.profiler.profile(activities=activities) as prof:
        for _ in range(profiled):
            tok = decode_step(model, cache, tok, pos)
            pos += 1
        _sync(device)
    events = prof.events()
    result["sections"] = section_table(events, policy_runs=args.layers)
    result["sections_note"] = "per policy run of one layer: the profiled interval ran one per layer"
    result["top_ops"] = top_ops(prof)
    result["launches_in_interval"] = sum(e.name in LAUNCH_EVENTS for e in events)
    result["syncs_in_interval"] = sum(e.name in SYNC_EVENTS for e in events)
    # One policy run of each layer alone, where the step would have run it (last: it moves the ring's phase).
    tok, pos = to_policy_eve(tok, pos)
    per_layer = []
    with torch.inference_mode():
        for layer in cache.layers:
            if not hasattr(layer, "run_policy"):
                continue
            _sync(device)
            t = time.perf_counter()
            layer.run_policy()
            _sync(device)
            per_layer.append(1e3 * (time.perf_counter() - t))
    result["run_policy_ms_per_layer"] = per_layer

    if not args.no_prefill:
        del cache
        result["prefill"] = prefill_profile(model, method, ids, device, cuda)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "policy_profile.json", json.dumps(result, indent=1, default=str))
    sm = result["step_ms"]
    print(
        f"policy_profile {result['device']} {shape} x{args.layers} layers {args.context} x {args.batch} "
        f"{method.label}: step {sm['median_without_policy']} ms, with policy {sm['median_with_policy']} ms; "
        f"run_policy per layer {[round(x, 2) for x in per_layer]} ms; layers' runs in the timed steps "
        f"{sm['policy_runs']}, {sm['runs_ahead']} prepared ahead"
    )
    print_sections(result["sections"], "host_ms_per_policy_run")
    for name, row in list(result["triton_launches"].items())[:12]:
        print(f"  launch {name:<28} {row['launches']:5d} x {row['us_median']:7.1f} us (mean {row['us_mean']:.1f})")
    if "prefill" in result:
        pf = result["prefill"]
        print(
            f"prefill: DynamicCache {pf['dynamic_s']:.3f} s, {method.label} {pf['hfkv_s']:.3f} s "
            f"({pf['ratio_dynamic_over_hfkv']:.2f}x); per layer:"
        )
        print_sections(pf["sections"], "device_ms_per_policy_run")
        synced = pf["synced_ms_per_layer"].items()
        print("  synchronised, ms per layer: " + ", ".join(f"{k} {v:.2f}" for k, v in synced))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
