"""Which launch shape makes the paged decode kernel fastest on this GPU, and where a call's time goes.

A lease on a GPU is minutes, so one command answers both questions for a few of kernel_bench's cases
(kind, context, batch; Llama-3.1-8B's attention shape, bf16): every variant of the grid ``block_n x
num_warps x num_stages x int_tile`` is timed on the same storage (CUDA-graph replays, as kernel_bench), its
output compared with the default launch's, and one call of the default launch is split by kernel
with ``torch.profiler`` (partial, combine, score: which one to work on). Rows are appended to the
JSON after each case, so a run stopped from outside keeps what it measured.

    python eval/kernel_variants.py --out eval/results/gpu/kernel_variants_DEVICE.json
    python eval/kernel_variants.py --dry-run --out /tmp/v.json     # a CPU, Triton's interpreter, toy sizes
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_bench as kb  # noqa: E402

from hfkv.atomic import write_atomic  # noqa: E402


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _cases(text: str) -> list[tuple[str, int, int]]:
    out = []
    for item in text.split(","):
        kind, *nums = item.split(":")
        if kind not in kb.KINDS or len(nums) != 2:
            raise argparse.ArgumentTypeError(f"--cases: {item!r} is not KIND:CONTEXT:BATCH with KIND in {kb.KINDS}")
        out.append((kind, int(nums[0]), int(nums[1])))
    return out


def kernel_split(call, device: torch.device, calls: int = 5) -> dict[str, float]:
    """GPU milliseconds per call of each kernel ``call`` launches (torch.profiler), by kernel name."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    split: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if us:
            split[evt.key[:80]] = us / 1e3 / calls
    return dict(sorted(split.items(), key=lambda kv: -kv[1]))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hfkv.kernels.decode_attention import paged_attention

    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    shape = kb.AttnShape.like("llama-3.1-8b")
    if args.dry_run:
        shape = kb.AttnShape(heads=8, kv_heads=2, head_dim=64, dtype=torch.float32)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "dry_run": args.dry_run,
        "shape": dict(heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim, dtype=str(shape.dtype)),
        "rows": [],
    }
    deadline = time.monotonic() + args.budget_s
    grid = list(itertools.product(args.block_n, args.num_warps, args.num_stages, args.int_tile, args.split_slots))
    for kind, context, batch in args.cases:
        plan = kb.make_plan(kind, context, batch, shape)
        st = kb.build_storage(plan, device)
        parts = st.parts(plan)
        pad_end = torch.zeros(batch, dtype=torch.int64, device=device)
        scale = shape.head_dim**-0.5
        read = kb.kernel_bytes(plan)["read_total"]

        def call(launch: dict[str, int], st=st, parts=parts, pad_end=pad_end, scale=scale, plan=plan):
            return paged_attention(st.query, parts, plan.context, pad_end, scale, "max", add_scores=False, **launch)[0]

        ref = call({})
        split = kernel_split(lambda call=call: call({}), device)
        for block_n, warps, stages, tile, split in grid:
            if time.monotonic() > deadline:
                result.setdefault("skipped", []).append(
                    f"{kind}:{context}:{batch} {block_n}/{warps}/{stages}/{tile}/{split}"
                )
                continue
            launch = {"block_n": block_n, "num_warps": warps, "num_stages": stages, "int_tile": bool(tile)}
            if split:  # slots per program (0: the library's sizing, ~256 programs over all parts' heads)
                launch["split_slots"] = split
            row: dict[str, Any] = {"kind": kind, "context": context, "batch": batch, **launch, "read_bytes": read}
            try:
                out = call(launch)
                row["rel_diff_vs_default"] = float((out.float() - ref.float()).norm() / ref.float().norm())
                t = kb.bench_kernel_case(plan, device, args.repeats, 3, True, False, launch, st)["timing"]
                row |= {"ms": t["ms_median"], "gbps": read / t["ms_median"] / 1e6, "mode": t["mode"]}
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result
                row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc) else ''}"
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        result.setdefault("kernel_split_ms", {})[f"{kind}:{context}:{batch}"] = split
        print(f"{kind}:{context}:{batch} kernel split (ms per call): {split}", flush=True)
        del st, parts, ref
        kb._free_cuda() if device.type == "cuda" else None
        write_atomic(args.out, json.dumps(result, indent=1))
    write_atomic(args.out, json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="JSON to write")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, toy sizes")
    p.add_argument("--cases", type=_cases, help="KIND:CONTEXT:BATCH,... (default full/hfkv at 32k x 8, hfkv 16k x 1)")
    p.add_argument("--block-n", type=_ints, default=[32, 64, 128])
    p.add_argument("--num-warps", type=_ints, default=[4, 8])
    p.add_argument("--num-stages", type=_ints, default=[2, 3])
    p.add_argument("--int-tile", type=_ints, default=[0, 1], help="integer codes read per element (0), as rows (1)")
    p.add_argument("--split-slots", type=_ints, default=[0], help="slots per program, 0 = the library's split sizing")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=120.0, help="variants past this are skipped (default 120)")
    args = p.parse_args(argv)
    if args.cases is None:
        args.cases = [("hfkv", 64, 1)] if args.dry_run else [("full", 32768, 8), ("hfkv", 32768, 8), ("hfkv", 16384, 1)]
    if args.dry_run:
        args.block_n, args.num_warps, args.num_stages, args.int_tile, args.repeats = [16, 32], [4], [2], [0, 1], 1
        args.split_slots = [0, 32]
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
