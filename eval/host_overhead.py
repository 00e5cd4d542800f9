"""Host side of a decode step and of a policy run: launches and Python time hfkv adds per compressed layer, on a CPU.

On a GPU a decode step is a stream of small launches, and the step can go no faster than the host
issues them: 32 compressed layers, each adding its window write, its attention and its score
update, must each cost the host less than the GPU spends on that layer, or the GPU idles. Targets
(reported, never asserted): at most 3 launches per compressed layer per step between policy runs,
and at most 40 us of host time for them.

What is measured, on a CPU: one compressed layer of Llama-3.1-8B's attention shape (32 query heads,
8 KV heads, head_dim 128, bf16) holding a ``--context`` (32k) token prompt. One layer stands for all
32: every compressed layer does the same host work, so the model has a single layer, built on the
``meta`` device (the cache reads its config only). The layer is filled by
``TriStateLayer.ingest_prefill`` from random keys and values, as a prefill forward leaves it
(scores, tiers, records at the ``--budget``). Each timed step is what hfkv adds between a layer's projections:
``cache.update(k, v, layer)`` and the ``"hfkv"`` attention function, as transformers calls them.

* Triton launches are recorded instead of run (``TRITON_INTERPRET=1``, with the interpreter's launch
  replaced by a recorder), so no GPU is needed and the time is the host's: Python, torch's dispatch
  of the small ops, the kernels' allocations. Triton's own launch path (argument binding, cache
  lookup) is not in it: on a GPU add its cost per launch.
* The torch ops of the step run on CPU tensors; they are small (one token's window write) and cost
  about their dispatch. A TorchDispatchMode counts every aten op that would launch a device kernel
  (views, allocations and metadata excluded) in a separate pass, since counting slows the step.
* The steps timed are those between policy runs: after ``interval - 1`` steps (the next would run the
  policy) the window ring and the step counters are put back to their state after the prefill,
  outside the timed region. A policy run in a timed step would be counted in
  ``policy_runs_in_timed_steps`` (0 by construction).
* Policy runs are counted (launches, host reads) and then timed apart (``policy_run``): each run
  executes every kernel untimed, and its host path is replayed ``--replays`` times on copies of the
  cache taken before it, with no kernel run and its host reads answered with the run's
  (``replayed_policy_run``: timing the run itself would count the caches the interpreter leaves cold).

Storage writes of the prefill use the torch backend (encoding 32k tokens in the interpreter would
take minutes); the layer is then switched to the Triton backend, whose storage layout is the same.
Timed only on a quiet machine (:mod:`hfkv.evaluation.quiet`: load below ``--max-load`` before and
after, recorded):

    python eval/host_overhead.py --wait-quiet 600      # writes hfkv-out/eval/host_overhead.json (working directory)
    python eval/host_overhead.py --wait-quiet 600 --out eval/results/host_overhead.json      # the committed file
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when hfkv's kernels are decorated, so before any import

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hfkv.evaluation import quiet  # noqa: E402
from hfkv.kernels.backend import backend_ops  # noqa: E402

TARGET_LAUNCHES, TARGET_HOST_US = 3, 40.0
# a run's default output, under the working directory; the committed eval/results/ only by --out
DEFAULT_OUT = Path("hfkv-out/eval/host_overhead.json")
ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "set_"}
METADATA = {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous", "_local_scalar_dense"}
# Ops whose result the host must wait for on a GPU: a value read back, or an output sized by the data.
HOST_SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "repeat_interleave", "unique", "_unique2"}


# ------------------------------------------------------------------------------------------ recording
# Kernels whose results the host reads (a policy run classifies from the metadata read_meta returns and moves
# what the allocation decides): they run as well as being recorded, or a policy run would decide from
# uninitialised memory.
INTERPRETING = [False]  # a recorded kernel runs in the interpreter now: its tensor copies are not counted
REPLAYING = [False]  # a policy run's host path replayed: no kernel runs (replayed_policy_run)
# Within a policy run's count every kernel but the decode step's runs too: the moves' compactions and reservations
# are read back (the step's attention would take minutes in the interpreter; its scores and ring are not read back).
RUN_ALL = [False]
DECODE_KERNELS = frozenset({"_partial_kernel", "_score_kernel", "_combine_kernel"})
RUN_WHILE_RECORDING = frozenset(
    {"_read_meta_kernel", "_candidates_kernel", "_items_kernel", "_scan_kernel", "_decide_kernel", "_changes_kernel"}
)


@contextmanager
def recorded_triton_launches():
    """Within the block, an interpreted ``kernel[grid](...)`` appends the kernel's name instead of running."""
    from triton.runtime.interpreter import InterpretedFunction

    names: list[str] = []
    run = InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        name = getattr(getattr(self, "fn", None), "__name__", str(self))
        names.append(name)
        # its outputs are read on the host: empty tensors would steer the policy
        if not REPLAYING[0] and (name in RUN_WHILE_RECORDING or (RUN_ALL[0] and name not in DECODE_KERNELS)):
            INTERPRETING[0] = True  # the interpreter's copies in and out are not the launch's device work
            try:
                return run(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                INTERPRETING[0] = False

    InterpretedFunction.run = record
    try:
        yield names
    finally:
        InterpretedFunction.run = run


@contextmanager
def timed_sorts(seconds: list[float]):
    """Within the block ``torch.sort`` and ``torch.argsort`` add their seconds to ``seconds[0]``: a policy run ranks its
    candidates with one, whose CPU compute here is device work on a GPU."""
    saved = torch.sort, torch.argsort

    def timed(fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[0] += time.perf_counter() - t0

        return call

    torch.sort, torch.argsort = timed(saved[0]), timed(saved[1])
    try:
        yield seconds
    finally:
        torch.sort, torch.argsort = saved


def host_numbers(layer) -> tuple:
    """What a policy run decides on the host: the tables' widths, the pool's size and free count, the tier peak,
    the ring's count and the step counters (a replay of the run's host path must leave the same)."""
    tiers = layer.tiers
    return (
        tuple(t.shape[-1] for t in tiers.tables),
        tuple(tiers.pool.data.shape),
        tiers.pool.n_free,
        layer.budget.tier_peak,
        layer.window.count,
        layer.window.start,
        layer.steps_since_policy,
        layer.length,
    )


def replayed_policy_run(
    layer, run_policy, args, kwargs, names: list[str], replays: int = 1
) -> tuple[Any, float, float]:
    """``(result, host seconds, sort seconds)`` of one policy run: it runs as it would (every kernel executed in the
    interpreter, untimed), and its host path is then timed ``replays`` times (the median kept), each on a fresh copy of
    the layer as it was before the run, with no kernel run and each host read (``Tensor.tolist``) answered with what
    the real run read; the sorts' CPU compute is taken out of the host seconds and returned beside them. Timing the
    real run itself, less its kernels' time, counts what the interpreter leaves behind: after each interpreted kernel
    the host's next small torch ops ran 10-20x slower than warm (cold caches; ``torch.empty`` 22 us against 1 us),
    which a GPU's host does not pay. Each replay must launch the kernels the run launched (``names``: the recorder's
    list) and leave the copy's host numbers (:func:`host_numbers`) as the run left the layer's: the same path."""
    import copy

    snapshot = copy.deepcopy(layer.cache)  # the whole cache: the layer refers to it
    reads: list[Any] = []
    tolist = torch.Tensor.tolist

    def recorded(tensor):
        value = tolist(tensor)
        reads.append(value)
        return value

    torch.Tensor.tolist = recorded
    start = len(names)
    try:
        out = run_policy(*args, **kwargs)
    finally:
        torch.Tensor.tolist = tolist
    launched, timed, sorted_s = len(names), [], []
    for _ in range(replays):
        twin = copy.deepcopy(snapshot).layers[layer.layer_idx]
        answers = iter(reads)

        def answered(tensor, answers=answers):
            try:
                return next(answers)
            except StopIteration:
                raise RuntimeError("host_overhead: the replayed policy run read more than the run did") from None

        torch.Tensor.tolist = answered
        REPLAYING[0] = True
        try:
            with timed_sorts([0.0]) as sorting:
                t0 = time.perf_counter()
                type(twin.policy).run(twin.policy, *args, **kwargs)
                seconds = time.perf_counter() - t0
        finally:
            REPLAYING[0] = False
            torch.Tensor.tolist = tolist
        ran, replayed = names[start:launched], names[launched:]
        if next(answers, None) is not None or host_numbers(twin) != host_numbers(layer) or ran != replayed:
            raise RuntimeError(
                f"host_overhead: the replayed policy run took another path ({host_numbers(twin)} after it, "
                f"{host_numbers(layer)} after the run; launches {replayed}, the run's {ran})"
            )
        del names[launched:]
        timed.append(seconds - sorting[0])
        sorted_s.append(sorting[0])
    return out, statistics.median(timed), statistics.median(sorted_s)


class DeviceOps(TorchDispatchMode):
    """Counts the aten ops that would launch a kernel on a GPU: all but views, allocations and metadata; and the host
    reads among them, with ``Tensor.tolist`` (which reads a CPU tensor's memory without an aten op; on a GPU it is a
    copy to the host and a wait)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self._tolist = None

    def __enter__(self):
        tolist = self._tolist = torch.Tensor.tolist
        syncs = self.syncs

        def counted_tolist(tensor):
            if not INTERPRETING[0]:
                syncs["tolist"] += 1
            return tolist(tensor)

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if INTERPRETING[0]:
            return func(*args, **(kwargs or {}))
        if not (func.is_view or name in ALLOCATIONS or name in METADATA):
            self.ops[name] += 1
        if name in HOST_SYNCS:
            self.syncs[name] += 1
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------- the layer
def build_layer(
    context: int, batch: int, shape_name: str, preset: str, budget: int | None, seed: int = 0
) -> tuple[Any, Any, dict[str, Any]]:
    """``(cache, layer, shape)``: a one-layer cache of ``shape_name``'s attention holding ``context`` tokens."""
    from hfkv import TriStateCache
    from hfkv.evaluation.shapes import build_random_like, get_shape

    shape = get_shape(shape_name)
    model = build_random_like(shape_name, layers=1, device="meta")  # the cache reads the config only
    # run_ahead off: a run is timed whole, where its step runs it (with it, the step before a run launches the run's
    # first part after its attention: the same host work, which would land in a timed step here)
    overrides = {"backend": "torch", "run_ahead": False} | ({"budget": budget} if budget is not None else {})
    cache = TriStateCache(model, preset, **overrides)
    g = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    k = torch.randn(batch, shape.kv_heads, context, shape.dim, generator=g).to(dt)
    v = torch.randn(batch, shape.kv_heads, context, shape.dim, generator=g).to(dt)
    q = torch.randn(batch, shape.heads, max(64, cache.config.obs_window), shape.dim, generator=g).to(dt)
    layer = cache.layers[0]
    layer.ingest_prefill(k, v, q, shape.dim**-0.5)
    # The prefill's storage writes ran on the torch backend; decode steps take the Triton path from here.
    layer.backend = "triton"
    layer.ops = layer.tiers.ops = backend_ops("triton")
    info = {
        "name": shape_name,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.dim,
        "dtype": "bf16",
    }
    return cache, layer, info


def decode_inputs(batch: int, info: dict[str, Any], n: int, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    kv = (batch, info["kv_heads"], 1, info["head_dim"])
    q = (batch, info["heads"], 1, info["head_dim"])
    return [tuple(torch.randn(*s, generator=g).to(torch.bfloat16) for s in (kv, kv, q)) for _ in range(n)]


def run_steps(cache, layer, inputs, between: int, watch=None, on_step=None, rewind: bool = True) -> list[float]:
    """Decode steps, the ring put back after every ``between`` steps (outside the timing); seconds per step.

    ``watch`` (a context manager) is entered around each step alone, ``on_step`` called after it; ``rewind=False``
    leaves the last steps' ring as it is (steps that ran policy runs: the tiers admitted its exits).
    """
    from contextlib import nullcontext

    from hfkv.attention.interface import hfkv_attention

    scaling = layer.window.k.shape[-1] ** -0.5
    ring = layer.window
    saved = [t.clone() for t in (ring.k, ring.v, ring.pos, ring.score)], ring.start, ring.count
    counters = layer.length, layer.steps_since_policy

    def restore() -> None:  # in place, so what the ring caches between steps stays cached, as in a real run
        for t, s in zip((ring.k, ring.v, ring.pos, ring.score), saved[0], strict=True):
            t.copy_(s)
        ring.start, ring.count = saved[1], saved[2]
        layer.length, layer.steps_since_policy = counters
        if layer.cursor.dev is not None:  # the device step the rewound ring's next token has, as a run's would
            layer.cursor.set(layer.length, (ring.start + ring.count) % ring.capacity)

    times = []
    for i, (k, v, q) in enumerate(inputs):
        if i and i % between == 0:
            restore()
        with watch or nullcontext():
            t0 = time.perf_counter()
            cache.update(k, v, 0)
            hfkv_attention(None, q, k, v, None, scaling=scaling)
            times.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step()
    if rewind:
        restore()
    return times


def measure(
    context: int = 32768,
    batch: int = 1,
    shape_name: str = "llama-3.1-8b",
    preset: str = "hfkv",
    budget: int | None = 2048,
    cycles: int = 40,
    warmup_cycles: int = 2,
    rounds: int = 5,
    policy_cycles: int = 8,
    replays: int = 5,
) -> dict[str, Any]:
    """Launches and host microseconds per compressed layer per decode step between policy runs, and per policy run
    (module docstring)."""
    from hfkv.kernels.environment import interpreter_on

    if not interpreter_on():
        raise RuntimeError("host_overhead records Triton launches in the interpreter: set TRITON_INTERPRET=1 first")
    t0 = time.perf_counter()
    cache, layer, info = build_layer(context, batch, shape_name, preset, budget)
    build_s = time.perf_counter() - t0
    between = max(1, layer.cfg.interval - 1)  # the interval-th step after a policy run runs the next one
    policy_runs, watched, policy_host_s, policy_sort_s = [0], [], [], []
    run_policy = layer.policy.run

    def counted_policy(*args, **kwargs):
        policy_runs[0] += 1
        if timing_policy[0]:  # the run's host seconds, replayed without its kernels (replayed_policy_run)
            out, seconds, sorting = replayed_policy_run(layer, run_policy, args, kwargs, names, replays)
            policy_host_s.append(seconds)
            policy_sort_s.append(sorting)
            return out
        if not watching[0]:
            return run_policy(*args, **kwargs)
        mode, start = DeviceOps(), len(names)
        with mode:
            out = run_policy(*args, **kwargs)
        watched.append({"torch": mode.ops, "syncs": mode.syncs, "triton": Counter(names[start:])})
        return out

    watching, timing_policy = [False], [False]

    layer.policy.run = counted_policy  # the runs the steps make
    per_step: list[dict[str, Any]] = []
    with recorded_triton_launches() as names:
        run_steps(cache, layer, decode_inputs(batch, info, between * warmup_cycles), between)
        # Counting pass: the Triton launches and torch's device ops of each step (counting slows it: not timed).
        mode = DeviceOps()
        start = [len(names)]

        def close_step() -> None:
            per_step.append({"triton": Counter(names[start[0] :]), "torch": Counter(mode.ops)})
            start[0] = len(names)
            mode.ops.clear()

        run_steps(cache, layer, decode_inputs(batch, info, between, seed=2), between, mode, close_step)
        policy_runs[0] = 0
        # Several rounds, each its own median: on this VM one run's median moves by tens of microseconds
        # from minute to minute, so the figure is the median of the rounds' medians, the rounds beside it.
        rounds_times = [
            run_steps(cache, layer, decode_inputs(batch, info, between * cycles, seed=3 + r), between)
            for r in range(rounds)
        ]
        times = [t for ts in rounds_times for t in ts]
        timed_policy_runs = policy_runs[0]
        # Then what a policy run itself launches and waits for (counted, not timed): steps run on until two ran.
        watching[0] = RUN_ALL[0] = True
        try:
            run_steps(cache, layer, decode_inputs(batch, info, 2 * (between + 1), seed=4), 10**9, rewind=False)
        finally:
            RUN_ALL[0] = False
        watching[0] = False
        # Then the host time of policy runs (replayed_policy_run); the steps between are recorded only.
        timing_policy[0] = RUN_ALL[0] = True
        try:
            steps = decode_inputs(batch, info, policy_cycles * (between + 1), seed=5)
            run_steps(cache, layer, steps, 10**9, rewind=False)
        finally:
            RUN_ALL[0] = timing_policy[0] = False
    triton = sum((s["triton"] for s in per_step), Counter())
    torch_ops = sum((s["torch"] for s in per_step), Counter())
    n = len(per_step)
    launches = (sum(triton.values()) + sum(torch_ops.values())) / n
    round_us = [1e6 * statistics.median(ts) for ts in rounds_times]
    host_us = statistics.median(round_us)
    st = layer.layer_stats()
    return {
        "launches_per_layer": launches,
        "host_us_per_layer": host_us,
        "host_us_per_layer_rounds": round_us,
        "host_us_per_layer_mean": 1e6 * statistics.fmean(times),
        "host_us_per_layer_p20_p80": [1e6 * _quantile(times, 0.2), 1e6 * _quantile(times, 0.8)],
        "triton_launches_per_layer": sum(triton.values()) / n,
        "torch_launches_per_layer": sum(torch_ops.values()) / n,
        "launches_by_kernel": {k: v / n for k, v in sorted(triton.items())},
        "torch_ops_per_step": {k: v / n for k, v in sorted(torch_ops.items())},
        "targets": {
            "launches_per_layer": {"target": f"<= {TARGET_LAUNCHES}", "met": launches <= TARGET_LAUNCHES},
            "host_us_per_layer": {"target": f"<= {TARGET_HOST_US:g} us", "met": host_us <= TARGET_HOST_US},
        },
        "timed_steps": len(times),
        "steps_between_restores": between,
        "policy_runs_in_timed_steps": timed_policy_runs,
        "policy_run": _policy_counts(watched) | _policy_host(policy_host_s, policy_sort_s) | {"replays": replays},
        "shape": info,
        "context": context,
        "batch": batch,
        "method": f"{preset}@{budget}" if budget is not None else preset,
        "tokens_held": _tier_tokens(st),  # summed over rows and KV heads
        "build_s": round(build_s, 1),
    }


def _policy_counts(runs: list[dict[str, Counter]]) -> dict[str, Any]:
    """Per policy run of one layer: device launches (torch ops and Triton kernels) and host syncs, averaged."""
    n = max(1, len(runs))
    total = lambda key: sum((r[key] for r in runs), Counter())  # noqa: E731
    torch_ops, syncs, triton = total("torch"), total("syncs"), total("triton")
    return {
        "runs": len(runs),
        "torch_launches_per_layer": sum(torch_ops.values()) / n,
        "triton_launches_per_layer": sum(triton.values()) / n,
        "host_syncs_per_layer": sum(syncs.values()) / n,
        "host_syncs_by_op": {k: v / n for k, v in sorted(syncs.items())},
        "top_torch_ops": {k: v / n for k, v in torch_ops.most_common(10)},
        "triton_by_kernel": {k: v / n for k, v in sorted(triton.items())},
    }


def _policy_host(seconds: list[float], sorting: list[float]) -> dict[str, Any]:
    """Host microseconds of one layer's policy run, its host path replayed with no kernel run (``replayed_policy_run``):
    Python, allocations and the torch ops on CPU tensors (their compute too: an upper bound of their dispatch) but
    its sorts (``sort_us_per_layer``: device work on a GPU); not Triton's own launch path, as for a step."""
    us = [1e6 * t for t in seconds]
    return {
        "host_us_per_layer": statistics.median(us) if us else None,
        "host_us_per_layer_mean": statistics.fmean(us) if us else None,
        "host_us_timed_runs": len(us),
        "host_us_runs": us,  # each run's median over its replays
        "sort_us_per_layer": 1e6 * statistics.median(sorting) if sorting else None,
    }


def _tier_tokens(st) -> dict[str, int]:
    totals = st.totals() if hasattr(st, "totals") else {}
    return {k: int(v) for k, v in totals.items() if isinstance(v, (int, float))}


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# -------------------------------------------------------------------------------------------- command
def main(argv: list[str] | None = None) -> int:
    from hfkv import cli_args as ca
    from hfkv.evaluation.results import machine_name, provenance, script_command, write_result_json

    ap = ca.ArgumentParser(
        prog="eval/host_overhead.py",
        description=__doc__.splitlines()[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--context", type=ca.integer(64), default=32768, help="prompt tokens held (default 32768)")
    ap.add_argument("--batch", type=ca.integer(1), default=1, help="rows (default 1)")
    ap.add_argument("--budget", type=ca.integer(1), default=2048, help="hfkv budget, fp_tokens per KV head (2048)")
    ap.add_argument("--cycles", type=ca.integer(1), default=40, help="timed runs of interval-1 steps (default 40)")
    ap.add_argument("--rounds", type=ca.integer(1), default=5, help="timed rounds of --cycles; median of medians (5)")
    ap.add_argument("--policy-runs", type=ca.integer(1), default=8, help="policy runs timed after the steps (8)")
    ap.add_argument("--replays", type=ca.integer(1), default=5, help="timed replays of each policy run; median (5)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result file (default: %(default)s)")
    quiet.add_arguments(ap, default_threads="1")
    try:
        args = ap.parse_args(argv)
        if len(args.threads) != 1:
            raise ca.UsageError("--threads", f"{args.threads} must be one thread count: the host path is one thread")
        record = quiet.start(args.threads, args.max_load, args.wait_quiet, args.force_busy)
    except ca.UsageError as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    if record["busy"]:
        print(f"warning: busy machine ({quiet.describe(record)}); the result is marked busy", file=sys.stderr)
    torch.set_num_threads(args.threads[0])
    result = measure(
        args.context, args.batch, budget=args.budget, cycles=args.cycles, rounds=args.rounds,
        policy_cycles=args.policy_runs, replays=args.replays,
    )  # fmt: skip
    quiet.finish(record)
    result |= {
        "what": "host time and launches hfkv adds per compressed layer per decode step between policy runs, and per "
        "policy run (policy_run: its host path replayed without its kernels); "
        "Triton launches recorded instead of run, torch ops on CPU tensors (eval/host_overhead.py docstring)",
        "threads": torch.get_num_threads(),
        "quiet": record,
        "busy": record["busy"],
        "command": script_command("eval/host_overhead.py", argv),
        **provenance(machine=machine_name()),
    }
    write_result_json(args.out, result)
    t, pol = result["targets"], result["policy_run"]
    print(
        f"{result['launches_per_layer']:.1f} launches per layer per step ({result['triton_launches_per_layer']:.0f} "
        f"Triton + {result['torch_launches_per_layer']:.0f} torch; target <= {TARGET_LAUNCHES}: "
        f"{'met' if t['launches_per_layer']['met'] else 'not met'}), host {result['host_us_per_layer']:.0f} us median "
        f"(target <= {TARGET_HOST_US:g}: {'met' if t['host_us_per_layer']['met'] else 'not met'}); "
        f"a policy run: {pol['host_us_per_layer']:.0f} us host median, {pol['triton_launches_per_layer']:g} Triton + "
        f"{pol['torch_launches_per_layer']:g} torch launches, {pol['host_syncs_per_layer']:g} host reads; "
        f"{quiet.describe(record)}{' BUSY' if record['busy'] else ''}\nwrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
