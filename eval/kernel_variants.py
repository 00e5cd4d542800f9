"""Which launch shape makes the paged decode kernel fastest on this GPU, and where a call's time goes.

A lease on a GPU is minutes, so one command answers both questions for a few of kernel_bench's cases
(kind, context, batch; Llama-3.1-8B's attention shape, bf16): every variant of the grid ``block_n x
num_warps x num_stages x int_tile`` (and of the reads: pieces, table ahead, score blocks, fp16
dequantization) is timed on the same storage (CUDA-graph replays, as kernel_bench), its
output compared with the default launch's, and one call of the default launch is split by kernel
with ``torch.profiler`` (partial, combine, score: which one to work on). Rows are appended to the
JSON after each case, so a run stopped from outside keeps what it measured.

The storage varies too, to tell the paged addressing's cost from the loop's: ``--page-records`` (records
per page; the library's pages hold 11 of Llama's bf16 records, 10 before they started on 32-byte sectors),
``--record-align 16`` (records padded to 16 bytes, so every field can be one 16-byte copy) and the case kind
``dense`` (the whole context in one dense part, the window ring's path: no page table, what flash SDPA
reads). The same seed draws the same tokens for every storage, so each row's output is also compared with the
case's first storage.

    python -m eval.kernel_variants --out v.json --cases full:32768:8,dense:32768:8 --page-records 0,128 \
        --record-align 4,16

    python -m eval.kernel_variants --out eval/results/gpu/kernel_variants_DEVICE.json
    python -m eval.kernel_variants --dry-run --out /tmp/v.json     # a CPU, Triton's interpreter, toy sizes

Run from the repository root as ``python -m eval.kernel_variants``: it imports ``eval.kernel_bench`` of this package
(a plain ``python -m eval.kernel_variants`` puts only its own folder on the import path, which does not reach them).
"""

from __future__ import annotations

import argparse
import dataclasses
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

from eval import kernel_bench as kb  # noqa: E402
from hfkv.atomic import write_atomic  # noqa: E402
from hfkv.quant.record import META_BYTES, RecordLayout  # noqa: E402

# ``dense``: the context in one DenseSlots part (the window ring's path: rows of [B, H, S, D], no page table,
# 16-byte aligned), what flash SDPA reads, through this kernel: is the paged addressing or the loop the cost?
CASE_KINDS = (*kb.KINDS, "dense")


@dataclasses.dataclass(frozen=True)
class Aligned16Layout(RecordLayout):
    """A record padded to a multiple of 16 bytes (the tag and score at its end), so every field of every record
    can be a 16-byte load (``cp.async.cg``); the library's records are 4-aligned (8 for Llama's bf16)."""

    def body_bytes(self, kv_bytes: int) -> int:
        return -(-(kv_bytes + META_BYTES) // 16) * 16 - META_BYTES


def variant_plan(kind: str, context: int, batch: int, shape, page_records: int, align: int):
    """kernel_bench's plan for ``kind``, its pages holding ``page_records`` of its largest record (0: the library's
    size) and its records padded to ``align`` bytes (4: the library's records; 16: ``Aligned16Layout``)."""
    if kind == "dense":
        plan = kb.make_plan("full", context, batch, shape)
        paged = min(128, context // 2)
        return dataclasses.replace(plan, kind="dense", window=context - paged, tier_tokens=(paged, 0))
    plan = kb.make_plan(kind, context, batch, shape)
    if align == 16:
        lays = tuple(Aligned16Layout(lay.key, lay.value) for lay in plan.layouts)
        plan = dataclasses.replace(plan, layouts=lays, page_bytes=kb.auto_page_bytes([lay.nbytes for lay in lays]))
    elif align != 4:
        raise ValueError(f"--record-align: {align} is not 4 or 16")
    if page_records:
        plan = dataclasses.replace(plan, page_bytes=page_records * max(lay.nbytes for lay in plan.layouts))
    return plan


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _cases(text: str) -> list[tuple[str, int, int]]:
    out = []
    for item in text.split(","):
        kind, *nums = item.split(":")
        if kind not in CASE_KINDS or len(nums) != 2:
            raise argparse.ArgumentTypeError(f"--cases: {item!r} is not KIND:CONTEXT:BATCH with KIND in {CASE_KINDS}")
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


def reference_output(query: torch.Tensor, parts, context: int, pad_end: torch.Tensor, scale: float):
    """The torch twin's output and per-slot probabilities in fp32 over the same storage (None where they do not fit
    in memory): how far each launch is from exact attention, not only from the default launch, which rounds too
    (kernel_variants_h200_run5.json put the two dequantization forms 3% apart, which eval/dequant_rounding.py
    places on the fp32 form's side). The probabilities depend on the keys alone, so a launch whose output is off
    but whose probabilities are not has its error on the values' side."""
    from hfkv.kernels.decode_attention import paged_attention_reference

    try:
        out, delta = paged_attention_reference(query.float(), parts, context, pad_end, scale, "max", add_scores=False)
        return out.float(), delta.float()
    except torch.OutOfMemoryError:
        return None


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
    grid = list(
        itertools.product(
            args.block_n,
            args.num_warps,
            args.num_stages,
            args.int_tile,
            args.split_slots,
            args.int_pieces,
            args.table_ahead,
            args.score_block,
            args.half_dequant,
            args.max_registers,
            args.column_sums,
            args.operand_fence,
            args.asm_dequant,
            args.spread_banks,
            args.code_dots,
        )
    )
    storages = list(itertools.product(args.page_records, args.record_align))
    case_ref: dict[tuple, torch.Tensor] = {}
    for (kind, context, batch), (page_records, align) in itertools.product(args.cases, storages):
        if kind == "dense" and (page_records, align) != storages[0]:
            continue  # no pages, no records
        plan = variant_plan(kind, context, batch, shape, page_records, align)
        st = kb.build_storage(plan, device)
        parts = st.parts(plan)
        pad_end = torch.zeros(batch, dtype=torch.int64, device=device)
        scale = shape.head_dim**-0.5
        read = kb.kernel_bytes(plan)["read_total"]

        def call(launch: dict[str, int], st=st, parts=parts, pad_end=pad_end, scale=scale, plan=plan):
            return paged_attention(st.query, parts, plan.context, pad_end, scale, "max", add_scores=False, **launch)

        ref, _ = call({})
        twin = reference_output(st.query, parts, plan.context, pad_end, scale)
        if kind != "dense":  # the same seed draws the same tokens whatever the pages and records look like
            first = case_ref.setdefault((kind, context, batch), ref)
            storage_diff = kb._rel_err(ref, first)
        kernels_ms = kernel_split(kb.decode_call(st, parts, plan), device)
        result["kernel_split_call"] = "add_scores=True, return_delta=False (the timed call)"
        for variant in grid:
            (block_n, warps, stages, tile, split, pieces, ahead, score_block, half, regs, colsums, fence, asm,
             spread, code) = variant  # fmt: skip
            if time.monotonic() > deadline:
                result.setdefault("skipped", []).append(
                    f"{kind}:{context}:{batch} {block_n}/{warps}/{stages}/{tile}/{split}/{pieces}/{ahead}/"
                    f"{score_block}/{half}/{regs}/{colsums}/{fence}/{asm}/{spread}/{code}"
                )
                continue
            launch = {"block_n": block_n, "num_warps": warps or None, "num_stages": stages, "int_tile": bool(tile)}
            launch["int_pieces"] = bool(pieces)
            launch["half_dequant"] = bool(half)
            launch["column_sums"] = bool(colsums)
            launch["operand_fence"] = bool(fence)
            launch["asm_dequant"] = bool(asm)
            launch["spread_banks"] = bool(spread)
            launch["code_dots"] = code
            launch["table_ahead"] = ahead
            launch["score_block"] = score_block
            launch["max_registers"] = None if regs < 0 else regs  # 0: the compiler's choice; -1: the library's
            if split:  # slots per program (0: the library's sizing, one wave over all parts' heads)
                launch["split_slots"] = split
            row: dict[str, Any] = {"kind": kind, "context": context, "batch": batch, **launch, "read_bytes": read}
            row |= {"page_bytes": plan.page_bytes, "record_bytes": [lay.nbytes for lay in plan.layouts]}
            if kind != "dense":
                row["rel_diff_vs_first_storage"] = storage_diff
            try:
                out, delta = call(launch)
                row["rel_diff_vs_default"] = kb._rel_err(out, ref)
                if twin is not None:
                    row["rel_diff_vs_reference"] = kb._rel_err(out, twin[0])
                    row["probs_rel_diff_vs_reference"] = kb._rel_err(delta, twin[1])
                t = kb.bench_kernel_case(plan, device, args.repeats, 3, True, False, launch, st)["timing"]
                row |= {"ms": t["ms_median"], "gbps": read / t["ms_median"] / 1e6, "mode": t["mode"]}
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result
                row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc) else ''}"
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        name = f"{kind}:{context}:{batch}:page{plan.page_bytes}:align{align}"
        result.setdefault("kernel_split_ms", {})[name] = kernels_ms
        print(f"{name} kernel split (ms per call): {kernels_ms}", flush=True)
        del st, parts, ref, twin
        case_ref = {k: v for k, v in case_ref.items() if k == (kind, context, batch)}
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
    p.add_argument("--num-warps", type=_ints, default=[4, 8], help="warps of the partial pass (0: the library's)")
    p.add_argument("--num-stages", type=_ints, default=[2, 3])
    p.add_argument("--int-tile", type=_ints, default=[0, 1], help="integer codes read per element (0), as rows (1)")
    p.add_argument(
        "--int-pieces", type=_ints, default=[1], help="integer fields read in pieces (1) or by load_field (0)"
    )
    p.add_argument("--table-ahead", type=_ints, default=[1, 2], help="iterations ahead the page table is read")
    p.add_argument(
        "--half-dequant", type=_ints, default=[0, 1], help="integer fields dequantized in fp32 (0) or fp16 (1)"
    )
    p.add_argument(
        "--max-registers",
        type=_ints,
        default=[0],
        help="registers per thread of the partial pass (0: compiler's; -1: the library's, by storage)",
    )
    p.add_argument(
        "--column-sums", type=_ints, default=[1], help="softmax denominators summed per column (1) or row (0)"
    )
    p.add_argument(
        "--operand-fence", type=_ints, default=[1], help="integer tiles reach the products through an opaque identity"
    )
    p.add_argument(
        "--asm-dequant", type=_ints, default=[1], help="the fp16 dequantization's arithmetic as PTX (1) or Triton (0)"
    )
    p.add_argument(
        "--spread-banks", type=_ints, default=[1], help="integer tiles' columns ordered for conflict-free shared stores"
    )
    p.add_argument(
        "--code-dots", type=_ints, default=[0], help="products from integer codes: 0 off, 1 keys, 2 values, 3 both"
    )
    p.add_argument("--score-block", type=_ints, default=[64], help="slots per program of the score pass")
    p.add_argument("--split-slots", type=_ints, default=[0], help="slots per program, 0 = the library's split sizing")
    p.add_argument("--page-records", type=_ints, default=[0], help="records of the largest layout per page (0: auto)")
    p.add_argument("--record-align", type=_ints, default=[4], help="4: the library's records; 16: padded records")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=120.0, help="variants past this are skipped (default 120)")
    args = p.parse_args(argv)
    if args.cases is None:
        args.cases = [("hfkv", 64, 1)] if args.dry_run else [("full", 32768, 8), ("hfkv", 32768, 8), ("hfkv", 16384, 1)]
    if args.dry_run:
        args.block_n, args.num_warps, args.num_stages, args.int_tile, args.repeats = [16, 32], [4], [2], [0, 1], 1
        args.split_slots = [0, 32]
        args.page_records, args.record_align, args.table_ahead = [0], [4, 16], [1]
        args.half_dequant = [0]  # fp32 toy shape: the fp16 form never applies
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
