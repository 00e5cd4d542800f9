"""The CPU decode kernel from one thread to every core -> hfkv-out/eval/cpu_kernel_scaling.json (``--out``).

One decode call (one new token, scores added) of ``paged_attention_cpu`` over the storage of
``eval/kernel_bench.py``'s plans (``hfkv``: the preset's window ring, 1 token in 8 exact and the rest
K4V2; ``full``: every token an exact record), for one layer of a model's attention shape, at each
thread count. Beside it, at the same thread count, the step a DynamicCache pays for the same layer:
``scaled_dot_product_attention`` of the query over a dense K/V of the same length. Each timing is the
median and mean of ``--repeats`` calls after a warm-up; every thread count's output is compared with
the one-thread output (split-K changes the order of the sums, not the result).

Timed only on a quiet machine (``hfkv.evaluation.quiet``: load average below ``--max-load`` before
and after, recorded); ``eval/make_tables.py`` renders the table into eval/README.md and
docs/kernels.md.

    python -m eval.cpu_kernel_scaling --wait-quiet 600       # writes hfkv-out/eval/ under the working directory
    python -m eval.cpu_kernel_scaling --wait-quiet 600 --out eval/results/cpu_kernel_scaling.json  # the committed file

Run from the repository root as ``python -m eval.cpu_kernel_scaling``: it imports ``eval.kernel_bench`` of this
package (a plain ``python -m eval.cpu_kernel_scaling`` puts only its own folder on the import path, which does not
reach them).
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
from typing import Any

import torch

from eval.kernel_bench import AttnShape, build_storage, make_plan  # noqa: E402
from hfkv.atomic import write_atomic  # noqa: E402
from hfkv.evaluation import quiet  # noqa: E402
from hfkv.kernels.cpu.paged_decode import paged_attention_cpu  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OUT_DIR = Path("hfkv-out/eval")  # a run's default folder, under the working directory; eval/results/ only by --out


def default_threads(cpu_count: int | None = None) -> list[int]:
    """1, 2, 4, ... up to every core, and every core."""
    n = cpu_count or os.cpu_count() or 1
    out, t = [], 1
    while t < n:
        out.append(t)
        t *= 2
    return [*out, n]


def time_calls(fn, repeats: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"ms_median": 1e3 * statistics.median(times), "ms_mean": 1e3 * statistics.fmean(times)}


def run_case(shape_name: str, kind: str, context: int, batch: int, dtype: torch.dtype, threads: list[int],
             repeats: int, warmup: int) -> dict[str, Any]:  # fmt: skip
    shape = AttnShape.like(shape_name, dtype)
    plan = make_plan(kind, context, batch, shape)
    st = build_storage(plan, "cpu")
    parts = st.parts(plan)
    pad = torch.zeros(batch, dtype=torch.int64)
    scaling = shape.head_dim**-0.5
    g = torch.Generator().manual_seed(1)
    k = torch.randn(batch, shape.kv_heads, context, shape.head_dim, generator=g).to(dtype)
    v = torch.randn(batch, shape.kv_heads, context, shape.head_dim, generator=g).to(dtype)

    def kernel(n: int) -> torch.Tensor:
        return paged_attention_cpu(st.query, parts, context, pad, scaling, "max", add_scores=True,
                                   return_delta=False, threads=n)[0]  # fmt: skip

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(st.query, k, v, scale=scaling, enable_gqa=True)

    one = kernel(1).float()
    rows = []
    saved = torch.get_num_threads()
    try:
        for n in threads:
            torch.set_num_threads(n)
            diff = float((kernel(n).float() - one).abs().max())
            rows.append({
                "threads": n,
                "kernel": time_calls(lambda n=n: kernel(n), repeats, warmup),
                "sdpa_dense": time_calls(sdpa, repeats, warmup),
                "max_abs_diff_vs_1_thread": diff,
            })  # fmt: skip
            print(f"{shape_name} {kind} {context} b{batch} {n} thread(s): kernel {rows[-1]['kernel']['ms_median']:.3f} "
                  f"ms, dense SDPA {rows[-1]['sdpa_dense']['ms_median']:.3f} ms", flush=True)  # fmt: skip
    finally:
        torch.set_num_threads(saved)
    return {"shape": shape_name, **plan.describe(), "timings": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,llama-3.1-8b", help="attention shapes (hfkv.evaluation.shapes)")
    ap.add_argument("--kinds", default="hfkv,full", help="storage kinds of eval/kernel_bench.py")
    ap.add_argument("--contexts", default="8192,32768", help="tokens per (row, KV head)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="model dtype (default fp32, a CPU's)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    quiet.add_arguments(ap, default_threads=None)
    ap.add_argument("--out", type=Path, default=OUT_DIR / "cpu_kernel_scaling.json", help="default: %(default)s")
    args = ap.parse_args(argv)
    threads = args.threads or default_threads()
    try:
        record = quiet.start(threads, args.max_load, args.wait_quiet, args.force_busy)
    except quiet.BusyMachine as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "threads": threads,
        "quiet": record,
        "cases": [],
    }
    for shape in args.shapes.split(","):
        for kind in args.kinds.split(","):
            for ctx in (int(c) for c in args.contexts.split(",")):
                result["cases"].append(
                    run_case(shape, kind, ctx, args.batch, DTYPES[args.dtype], threads, args.repeats, args.warmup)
                )
    print("waiting for the run's own load to decay", flush=True)
    quiet.finish(record)
    result["busy"] = record["busy"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({quiet.describe(record)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
