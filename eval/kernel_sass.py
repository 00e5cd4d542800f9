"""What the decode kernel's partial pass compiles to on sm_90, read on a machine without a GPU.

A GPU lease is minutes; a kernel change can be judged before one. Triton ships the CUDA tools
(``ptxas``, ``cuobjdump``), so this compiles the partial pass exactly as a decode step of
``eval/kernel_bench.py``'s storage would launch it (``eval/gpu/aot.py``'s capture) and reads
the machine code: registers and stack per thread (spills), shared memory per program, and the main
loop's instructions by opcode, per warp and iteration and per slot (``instructions x warps /
block_n``). On the H100 lease this located the quantized read's per-element trips through shared
memory (``STS.U16`` / ``LDS.U16``) and the page-table loads each record copy waited on (docs/kernels.md).
It says nothing about time: stalls are the GPU's to show.

    python -m eval.kernel_sass --kinds full,quant,hfkv --launch "" --launch "block_n=128;num_warps=4"
    env -u TRITON_INTERPRET PYTHONPATH=.aot-triton python -m eval.kernel_sass   # the device image's Triton 3.6

Run from the repository root as ``python -m eval.kernel_sass``: it imports ``eval.kernel_bench`` and
``eval.gpu.aot`` of this package (a plain ``python -m eval.kernel_sass`` puts only its own folder on the import
path, which does not reach them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from eval import kernel_bench as kb  # noqa: E402
from hfkv.atomic import write_atomic  # noqa: E402

# Opcode families worth a column: global loads and copies, shared-memory traffic, spills, barriers, products.
KEY_OPS = ("LDG", "LDGSTS", "LDS", "STS", "LDSM", "STL", "LDL", "BAR", "HMMA", "SHFL")
MIN_LOOP = 100  # instructions: a loop over a part's slots is hundreds; shorter backward branches are not counted


def _launch(text: str) -> dict[str, int]:
    try:
        return {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(";") if item.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--launch: {text!r} is not 'name=int;name=int'") from None


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: this Triton wheel ships no {name}")
    return str(path)


def compile_partial(kind: str, launch: dict[str, int]):
    """The partial pass of one decode call over ``kind``'s storage (Llama-3.1-8B's shape, 2k tokens, batch 1),
    compiled for sm_90: the compiled kernel (its ``asm['cubin']``)."""
    from eval.gpu.aot import captured_launches, compile_launch
    from hfkv.kernels.decode_attention import paged_attention

    plan = kb.make_plan(kind, 2048, 1, kb.AttnShape.like("llama-3.1-8b"))
    st = kb.build_storage(plan, "cpu")
    with captured_launches() as calls:
        paged_attention(st.query, st.parts(plan), plan.context, torch.zeros(1, dtype=torch.long), 0.088, "max",
                        return_delta=False, **launch)  # fmt: skip
    return compile_launch(*next(c for c in calls if c[0].__name__ == "_partial_kernel"))


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


_WIDTHS = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def shared_bytes(loop: list[str]) -> dict[str, int]:
    """Bytes one warp asks of shared memory in one pass of ``loop``: loads (``LDS``, ``LDSM``) and stores (``STS``,
    ``STSM``, and ``LDGSTS``, the asynchronous copies' writes), 32 lanes times each instruction's width (``ldmatrix``:
    128 bytes a matrix), instructions predicated off (``@!PT``, placeholders the compiler puts around copies) left out.
    Requests, not wavefronts (lanes reading one address cost one, conflicts more): it locates traffic, a GPU times."""
    out = {"loaded": 0, "stored": 0}
    for text in loop:
        if text.startswith("@!PT"):
            continue
        fam, *mods = _opcode(text).split(".")
        width = next((_WIDTHS[m] for m in mods if m in _WIDTHS), 4)
        if fam in ("LDSM", "STSM"):  # LDSM.16.M88.4: four 8x8 matrices of 16-bit elements; LDSM.16.MT88: one
            out["loaded" if fam == "LDSM" else "stored"] += 128 * (int(mods[-1]) if mods[-1].isdigit() else 1)
        elif fam == "LDS":
            out["loaded"] += 32 * width
        elif fam in ("STS", "LDGSTS"):
            out["stored"] += 32 * width
    return out


def read_sass(cubin: bytes) -> dict[str, Any]:
    """Registers, stack and the largest loop's instruction mix of a cubin (``cuobjdump``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    res = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    insts = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?);", sass)]
    loop: list[str] = []
    sizes: list[int] = []  # every loop over slots, in code order: one per part the kernel instance reads
    for addr, text in insts:  # the longest backward branch: the loop over a program's slots
        m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)
        if m and m.group(1) and int(m.group(1), 16) < addr:
            body = [t for a, t in insts if int(m.group(1), 16) <= a <= addr]
            loop = body if len(body) > len(loop) else loop
            sizes += [len(body)] if len(body) >= MIN_LOOP else []
    ops: dict[str, int] = {}
    for text in loop:
        op = _opcode(text)
        ops[op] = ops.get(op, 0) + 1
    return {
        "registers": int(res.group(1)) if res else None,
        "stack_bytes": int(res.group(2)) if res else None,
        "instructions": len(insts),
        "loop_instructions": len(loop),
        "loops_instructions": sizes,
        "loop_ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
        "loop_shared_bytes_per_warp": shared_bytes(loop),
        "loop_families": {
            fam: sum(n for op, n in ops.items() if op == fam or op.startswith(fam + ".")) for fam in KEY_OPS
        },
    }


def tile_lane_columns(ttgir: str) -> list[list[int]]:
    """For each integer tile the loop hands to shared memory (a 2-D tensor in a ``#linear`` layout, the pieces'
    joins), the tile column each lane bit selects (0: a row bit): whether a quarter-warp's 16-byte stores spread over
    every bank (``SPREAD_BANKS``; lane 0 on column 32) or meet in half of them (lane 0 on column 64)."""
    layouts = {m.group(1): m.group(2) for m in re.finditer(r"^#(linear\d*) = #ttg\.linear<\{(.*)\}>$", ttgir, re.M)}
    out = []
    for m in re.finditer(r"ttg\.local_alloc %\S+ : \(tensor<\d+x\d+x\w+, #(linear\d*)>\)", ttgir):
        lane = re.search(r"lane = \[(.*?)\]\], warp", layouts.get(m.group(1), ""))
        if lane:
            out.append([int(v.split(",")[1]) for v in re.findall(r"\[(\d+, \d+)", lane.group(1) + "]")])
    return out


def shared_tiles(ttgir: str) -> dict[str, list[str]]:
    """The tensors the partial pass stages in shared memory, as ``RxCxtype``: ``stored`` from registers (a tile
    dequantized or converted there, then stored: ``STS``), ``async_copied`` straight from global memory (``cp.async``,
    no register on the way). Products from codes (``CODE_DOTS``) store no ``BLOCK_N x D`` fp16 tile and copy the code
    bytes instead."""
    stored = re.findall(r"ttg\.local_alloc %\S+ : \(tensor<([0-9x]+x\w+?)[,>]", ttgir)
    copied = re.findall(r"ttg\.async_copy_global_to_local .*? -> <([0-9x]+x\w+?)[,>]", ttgir)
    return {"stored": sorted(stored), "async_copied": sorted(copied)}


def analyse(kind: str, launch: dict[str, int]) -> dict[str, Any]:
    from hfkv.kernels.decode_attention import BLOCK_N

    kernel = compile_partial(kind, launch)
    row = {"kind": kind, "launch": launch, "shared_bytes": kernel.metadata.shared, **read_sass(kernel.asm["cubin"])}
    # the products' operand fragment widths (mma v2 kWidth): 2 is the tensor cores' pair of 16-bit elements
    row["dot_operand_kwidths"] = sorted({int(w) for w in re.findall(r"kWidth = (\d+)", kernel.asm["ttgir"])})
    # inline PTX: operand fences (OPERAND_FENCE) and the fp16 dequantization's pairs (ASM_DEQUANT)
    row["inline_asm_ops"] = kernel.asm["ttgir"].count("elementwise_inline_asm")
    row["tile_lane_columns"] = tile_lane_columns(kernel.asm["ttgir"])
    row["shared_tiles"] = shared_tiles(kernel.asm["ttgir"])
    warps, block_n = kernel.metadata.num_warps, launch.get("block_n", BLOCK_N)  # as the launch chose them
    row["num_warps"] = warps
    row["loop_warp_instructions_per_slot"] = row["loop_instructions"] * warps / block_n
    row["loops_warp_instructions_per_slot"] = [n * warps / block_n for n in row["loops_instructions"]]
    # all warps, one pass of the loop (block_n slots)
    row["loop_shared_bytes"] = {k: v * warps for k, v in row["loop_shared_bytes_per_warp"].items()}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="full,quant,hfkv", help="kernel_bench storage kinds (default full,quant,hfkv)")
    p.add_argument("--launch", type=_launch, action="append", help="paged_attention options, 'name=int;...'")
    p.add_argument("--out", type=Path, help="JSON to write (rows)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("kernel_sass compiles for sm_90: run it without TRITON_INTERPRET=1")
    kinds = [k for k in args.kinds.split(",") if k]
    if bad := [k for k in kinds if k not in kb.KINDS]:
        p.error(f"--kinds: {bad} not in {kb.KINDS}")
    rows = []
    for kind in kinds:
        for launch in args.launch or [{}]:
            row = analyse(kind, launch)
            rows.append(row)
            fam = " ".join(f"{k} {v}" for k, v in row["loop_families"].items() if v)
            print(f"{kind:<6} {json.dumps(launch):<40} regs {row['registers']} stack {row['stack_bytes']} "
                  f"shared {row['shared_bytes']}  loop {row['loop_instructions']} "
                  f"({row['loop_warp_instructions_per_slot']:.1f} per slot)  "
                  f"kWidth {row['dot_operand_kwidths']}  {fam}", flush=True)  # fmt: skip
    if args.out:
        import triton

        from hfkv.evaluation.results import provenance, script_command

        meta = {
            "triton": triton.__version__,  # the machine code differs between Triton versions (docs/kernels.md)
            "command": script_command("eval/kernel_sass.py", argv),
            **provenance(),
        }
        write_atomic(args.out, json.dumps({"rows": rows, **meta}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
