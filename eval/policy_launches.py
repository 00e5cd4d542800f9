"""Launches and host reads of a policy run, per layer and per section, counted on a CPU from a real forward.

On a GPU a policy run is bound by what it launches and how often it waits for the device (docs/kernels.md,
"Runs on a GPU": ~150 launches and ~12 waits a layer, ~3.3 ms, every 8 steps). ``eval/host_overhead.py`` counts a
run on a layer filled from random keys, where the exits are admitted and nothing is demoted; here a random-weight
model (``--shape``, default ``cpu-small``) prefills a prompt and decodes through the cache on the Triton backend
(Triton's interpreter, so toy sizes), and the runs after ``--warmup-runs`` are counted while the model's own ops
are not: every aten op that would launch a device kernel (views, allocations and metadata excluded), every Triton
launch, every host read (``nonzero``, ``item``, ``tolist``, ``bool``), each attributed to the innermost labelled
section it ran in (``candidates``, ``classify``, ``tier_changes``, ``remove``, ``reserve``, ``append_tokens``, ...;
``run_policy`` is what the run does outside them). Device time is not modelled; the counts are what a GPU run's
host issues (a torch op or a Triton launch each), and its waits.

    python -m eval.policy_launches --out eval/results/policy_launches.json

Counting only (no clock), so the machine need not be quiet.

Run from the repository root as ``python -m eval.policy_launches``: it imports ``eval.host_overhead`` and
``eval.policy_profile`` of this package (a plain ``python -m eval.policy_launches`` puts only its own folder on the
import path, which does not reach them).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when hfkv's kernels are decorated, so before any import

import argparse  # noqa: E402
from collections import Counter, defaultdict  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from eval.host_overhead import ALLOCATIONS, DECODE_KERNELS, HOST_SYNCS, METADATA  # noqa: E402
from eval.policy_profile import SECTIONS, patched  # noqa: E402

# Sections besides policy_profile's: where a run's host reads and storage writes happen.
EXTRA_SECTIONS = (
    ("moves", "tier_changes", "tier_changes"),
    ("budget", "refresh_peak", "refresh_tier_peak"),
    ("tiers", "_reserve_offsets", "reserve"),
    ("tiers", "gather_decoded", "gather_decoded"),
    ("tiers", "gather_decoded_into", "gather_decoded"),
)
READS = ("tolist", "item", "__bool__")  # host reads of a CPU tensor that do not all reach the dispatcher
SYNC_OPS = HOST_SYNCS | {"nonzero_numpy", "is_nonzero", "item"}


class Counts:
    """Per section: torch ops, Triton launches and host reads, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.stack = ["model"]
        self.torch: dict[str, Counter] = defaultdict(Counter)
        self.triton: dict[str, Counter] = defaultdict(Counter)
        self.reads: dict[str, Counter] = defaultdict(Counter)
        self.inside = 0  # a read or a launch being counted: what it does inside is not counted again

    def section(self) -> str:
        return self.stack[-1]


@contextmanager
def counting(counts: Counts):
    """Within the block: aten ops, Triton launches and host reads counted into ``counts`` (when ``counts.on``)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def launch(self, *args, grid, warmup, **kwargs):
        name = self.fn.__name__
        if counts.on and not counts.inside and name not in DECODE_KERNELS:
            counts.triton[counts.section()][name] += 1
        counts.inside += 1  # the interpreter's own copies around the kernel are no device work of the run
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            counts.inside -= 1

    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def read(name):
        fn = originals[name]

        def counted(tensor, *a, **kw):
            if counts.on and not counts.inside:
                counts.reads[counts.section()][name.strip("_")] += 1
            counts.inside += 1
            try:
                return fn(tensor, *a, **kw)
            finally:
                counts.inside -= 1

        return counted

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if counts.on and not counts.inside:
                if not (func.is_view or name in ALLOCATIONS or name in METADATA):
                    counts.torch[counts.section()][name] += 1
                if name in SYNC_OPS:
                    counts.reads[counts.section()][name] += 1
            return func(*args, **(kwargs or {}))

    def label(fn, name):
        def wrapped(*a, **kw):
            counts.stack.append(name)
            try:
                return fn(*a, **kw)
            finally:
                counts.stack.pop()

        return wrapped

    from hfkv.layer.budget import Budget
    from hfkv.storage.moves import Moves
    from hfkv.storage.paged import PagedTiers

    # the extra sections' (counting older code: those it has)
    owners = {"moves": Moves, "budget": Budget, "tiers": PagedTiers}
    sections = SECTIONS + tuple(s for s in EXTRA_SECTIONS if s[1] in owners[s[0]].__dict__)
    InterpretedFunction.run = launch
    for name in READS:
        setattr(torch.Tensor, name, read(name))
    try:
        with patched(sections, label), Ops():
            yield
    finally:
        InterpretedFunction.run = run
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def measure(
    method: str = "hfkv@64:backend=triton",
    shape: str = "cpu-small",
    context: int = 384,
    batch: int = 4,
    runs: int = 2,
    warmup_runs: int = 1,
) -> dict[str, Any]:
    """Per policy run of one layer: launches and host reads by section (module docstring)."""
    from hfkv.evaluation.bench import decode_step, fill_cache, random_prompt
    from hfkv.evaluation.methods import parse_method
    from hfkv.evaluation.shapes import build_random_like

    spec = parse_method(method)
    model = build_random_like(shape, 1, torch.float32, torch.device("cpu"), context + 256)
    cache = spec.make_cache(model, max_cache_len=context + 256)
    tok = fill_cache(model, cache, random_prompt(model.config.vocab_size, batch, context))
    layer = cache.layers[0]
    counts, pos, done, moved = Counts(), context, 0, []
    with counting(counts):
        while done < warmup_runs + runs:
            # only the step that runs the policy and the one before it, which launches the run's first part (section
            # run_ahead), and only the run's work (the steps' attention and the model's ops aside)
            counted = done >= warmup_runs and layer.steps_since_policy >= layer.cfg.interval - 2
            before = layer.tiers.counts.clone()
            counts.on = counted
            tok = decode_step(model, cache, tok, pos)
            counts.on = False
            pos += 1
            if layer.steps_since_policy == 0:
                if counted:
                    moved.append(int((layer.tiers.counts - before).abs().sum()))
                done += 1
    for step_part in ("model", "attend"):  # the step's own work (the forward, its attention), not the run's
        for table in (counts.torch, counts.triton, counts.reads):
            table.pop(step_part, None)
    per = float(runs)
    sections = {}
    for name in sorted(set(counts.torch) | set(counts.triton) | set(counts.reads)):
        t, k, r = counts.torch[name], counts.triton[name], counts.reads[name]
        sections[name] = {
            "torch": sum(t.values()) / per,
            "triton": sum(k.values()) / per,
            "host_reads": sum(r.values()) / per,
            "torch_ops": {op: n / per for op, n in t.most_common()},
            "triton_kernels": {op: n / per for op, n in sorted(k.items())},
            "reads": {op: n / per for op, n in sorted(r.items())},
        }
    torch_n = sum(s["torch"] for s in sections.values())
    triton_n = sum(s["triton"] for s in sections.values())
    st = layer.layer_stats()
    return {
        "launches_per_run": torch_n + triton_n,
        "torch_launches_per_run": torch_n,
        "triton_launches_per_run": triton_n,
        "host_reads_per_run": sum(s["host_reads"] for s in sections.values()),
        "sections": sections,
        "runs_counted": runs,
        "tier_count_changes_per_run": moved,  # tokens that changed tier in each counted run (summed |delta|)
        "moves_planned_on_device": layer.ops.plans_moves,
        "method": spec.label,
        "shape": shape,
        "context": context,
        "batch": batch,
        "tokens_held": {k: int(v) for k, v in st.totals().items() if isinstance(v, (int, float))},
    }


def main(argv: list[str] | None = None) -> int:
    from hfkv import cli_args as ca
    from hfkv.evaluation.results import machine_name, provenance, script_command, write_result_json

    ap = ca.ArgumentParser(prog="eval/policy_launches.py", description=__doc__.splitlines()[0], epilog=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--method", default="hfkv@64:backend=triton", help="method spec (default: %(default)s)")
    ap.add_argument("--shape", default="cpu-small", help="random model shape (default: %(default)s)")
    ap.add_argument("--context", type=ca.integer(16), default=384, help="prompt tokens (default 384)")
    ap.add_argument("--batch", type=ca.integer(1), default=4, help="rows (default 4)")
    ap.add_argument("--runs", type=ca.integer(1), default=2, help="policy runs counted (default 2)")
    ap.add_argument("--out", type=Path, required=True, help="result file")
    args = ap.parse_or_report(argv)
    if args is None:
        return 2
    result = measure(args.method, args.shape, args.context, args.batch, args.runs)
    result |= {
        "what": "launches and host reads of one layer's policy run, by section, counted on a CPU from a real "
        "forward (eval/policy_launches.py docstring)",
        "command": script_command("eval/policy_launches.py", argv),
        **provenance(machine=machine_name()),
    }
    write_result_json(args.out, result)
    print(
        f"{result['launches_per_run']:.1f} launches per policy run of a layer ({result['torch_launches_per_run']:.1f} "
        f"torch + {result['triton_launches_per_run']:.1f} Triton), {result['host_reads_per_run']:.1f} host reads\n"
        + "\n".join(
            f"  {k:18s} torch {v['torch']:5.1f}  triton {v['triton']:4.1f}  reads {v['host_reads']:3.1f}"
            for k, v in result["sections"].items()
        )  # fmt: skip
        + f"\nwrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
