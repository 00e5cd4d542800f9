"""Decode steps compiled (hfkv.compiled.CompiledDecode, inductor, fullgraph) against eager, on a CPU, in one process.

For each model, at one context, every entry below holds its own cache, filled by the same prompt; the entries then
step in turns (one step each, repeated: a shared VM drifts, interleaving keeps the ratios honest), after warm-up
steps that also compile. Entries:

- ``dynamic`` / ``dynamic+compiled``: DynamicCache, eager and compiled (transformers' own model under inductor);
- ``hfkv-cpu`` / ``hfkv-cpu+compiled``: ``hfkv@budget`` on the CPU kernel (what a CPU user runs by default), eager and
  compiled (the kernel is the operator ``hfkv::paged_attention_cpu`` in the graph; a policy-run step runs eagerly
  inside the compiled entry, and is timed with it);
- ``hfkv-torch`` / ``hfkv-torch+compiled`` (only when named in ``--entries``): the torch reference backend, compiled
  with ``dynamic=None`` (docs/generate.md, "torch.compile": traced dynamic from the start, its many symbolic sizes
  make each layer's trace slower than the last).

Models: ``cpu-small`` (eval/cpu_cache_figures.py's random Llama, fp32) and ``smollm2`` (SmolLM2-135M-Instruct,
bf16; needs the ``smollm2`` extra). Timing only on a quiet machine (hfkv.evaluation.quiet, docs/bench.md "Timing
honestly"), at each of ``--threads``.

    python -m eval.compile_figures        # writes hfkv-out/eval/compile_figures.json under the working directory
    python -m eval.compile_figures --out eval/results/compile_figures.json   # the committed file
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import hfkv
from hfkv.atomic import write_atomic
from hfkv.compiled import CompiledDecode
from hfkv.evaluation import quiet
from hfkv.evaluation.bench import decode_step, fill_cache, random_prompt
from hfkv.evaluation.results import provenance
from hfkv.evaluation.shapes import build_random_like

OUT = Path("hfkv-out/eval/compile_figures.json")


def load(name: str, context: int):
    if name == "cpu-small":
        return build_random_like("cpu-small", max_positions=max(16384, context + 1024), seed=0)
    from hfkv.loading import load_model  # the real model: the smollm2 extra

    return load_model("smollm2", dtype=torch.bfloat16)[0]  # (model, tokenizer)


ENTRIES = ("dynamic", "dynamic+compiled", "hfkv-cpu", "hfkv-cpu+compiled")


def entries(model, budget: int, names: list[str]) -> tuple[dict[str, tuple], dict[str, CompiledDecode]]:
    """name -> (make a cache, the callable a step goes through), for ``names``; and the compiled wrappers."""
    compiled, reference = CompiledDecode(model), CompiledDecode(model, dynamic=None)
    hfkv_cfg = dict(budget=budget)
    table = {
        "dynamic": (lambda: DynamicCache(config=model.config), model),
        "dynamic+compiled": (lambda: DynamicCache(config=model.config), compiled),
        "hfkv-torch": (lambda: hfkv.TriStateCache(model, "hfkv", backend="torch", **hfkv_cfg), model),
        "hfkv-torch+compiled": (lambda: hfkv.TriStateCache(model, "hfkv", backend="torch", **hfkv_cfg), reference),
        "hfkv-cpu": (lambda: hfkv.TriStateCache(model, "hfkv", backend="cpu", **hfkv_cfg), model),
        "hfkv-cpu+compiled": (lambda: hfkv.TriStateCache(model, "hfkv", backend="cpu", **hfkv_cfg), compiled),
    }
    unknown = sorted(set(names) - set(table))
    if unknown:
        raise ValueError(f"--entries: unknown {unknown}; allowed: {sorted(table)}")
    return {name: table[name] for name in names}, {"dynamic=True": compiled, "dynamic=None": reference}


def measure(model, context: int, budget: int, steps: int, warmup: int, names: list[str]) -> dict:
    # Dynamo keeps at most recompile_limit graphs per code object, and both cache kinds go through the model's one
    # forward: a DynamicCache's graphs and a TriStateCache's (a few each, between their policy runs) share it
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    table, compiled = entries(model, budget, names)
    ids = random_prompt(model.config.vocab_size, 1, context)
    caches = {name: make() for name, (make, _) in table.items()}
    with torch.inference_mode():
        tokens = {name: fill_cache(model, cache, ids, 1024) for name, cache in caches.items()}
    times: dict[str, list[float]] = {name: [] for name in table}
    first: dict[str, float] = {}
    for i in range(warmup + steps):
        for name, (_, step) in table.items():
            t0 = time.perf_counter()
            tokens[name] = decode_step(step, caches[name], tokens[name], context + i)
            dt = time.perf_counter() - t0
            if i == 0:
                first[name] = dt  # the compiled entries' first step compiles
            if i >= warmup:
                times[name].append(dt)
    counts = {k: dict(c.counts) for k, c in compiled.items()}
    out = {"context": context, "budget": budget, "steps": steps, "warmup": warmup, "counts": counts}
    for name, ts in times.items():
        out[name] = {
            "ms_median": statistics.median(ts) * 1e3,
            "ms_mean": statistics.fmean(ts) * 1e3,
            "first_step_s": first[name],
            "ms": [round(t * 1e3, 3) for t in ts],  # every timed step: where a recompile fell
        }
    for base, other in (("dynamic", "dynamic+compiled"), ("hfkv-torch", "hfkv-torch+compiled"),
                        ("hfkv-cpu", "hfkv-cpu+compiled"), ("dynamic", "hfkv-cpu"), ("dynamic", "hfkv-torch+compiled"),
                        ("dynamic", "hfkv-cpu+compiled"), ("dynamic+compiled", "hfkv-cpu+compiled")):  # fmt: skip
        if base not in out or other not in out:
            continue
        out[f"{other} vs {base}"] = {
            "speedup_median": out[base]["ms_median"] / out[other]["ms_median"],
            "speedup_mean": out[base]["ms_mean"] / out[other]["ms_mean"],
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="cpu-small,smollm2")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument(
        "--entries", default=",".join(ENTRIES), help="default: %(default)s; also hfkv-torch, hfkv-torch+compiled"
    )
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=48, help="steps dropped (compiles and recompiles happen here)")
    quiet.add_arguments(ap, default_threads="1")
    ap.add_argument("--out", type=Path, default=OUT, help="default: %(default)s")
    args = ap.parse_args(argv)
    try:
        record = quiet.start(args.threads, args.max_load, args.wait_quiet, args.force_busy)
    except quiet.BusyMachine as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "quiet": record,
        "runs": [],
    }
    threads = torch.get_num_threads()
    names = [e.strip() for e in args.entries.split(",") if e.strip()]
    try:
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            model = load(name, args.context)
            for n in args.threads:
                torch.set_num_threads(n)
                torch._dynamo.reset()
                run = {"model": name, "threads": n, **measure(model, args.context, args.budget, args.steps,
                                                               args.warmup, names)}  # fmt: skip
                result["runs"].append(run)
                print(json.dumps({k: v for k, v in run.items() if " vs " in k or k in ("model", "threads")}),
                      flush=True)  # fmt: skip
                write_atomic(args.out, json.dumps(result, indent=2))
    finally:
        torch.set_num_threads(threads)
    quiet.finish(record)
    result |= {k: v for k, v in provenance().items() if k not in result}
    result["busy"] = record["busy"]
    write_atomic(args.out, json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
