"""Every kernel configuration the cache launches compiles for Hopper (sm_90), without a GPU.

The interpreter runs the kernels' arithmetic on a CPU but never compiles them; this runs Triton's
real compiler chain (ptxas ships with Triton) on the launches the wrappers make, captured without
running, in a process where TRITON_INTERPRET is off, with the launcher's own specialisation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

KERNELS = ("_partial_kernel", "_combine_kernel", "_score_kernel")
KERNELS += ("_encode_write_kernel", "_move_kernel", "_clear_kernel")
KERNELS += ("_fits_kernel", "_scan_kernel", "_decide_kernel")  # the allocation's, past its fast path too


@pytest.mark.slow
def test_all_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "eval.gpu.aot"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].endswith("kernel configurations compiled for sm_90")
    # A decode step compiles one instance of each kernel whatever the storage's sizes and the token's
    # position: the launcher's integer specialisation made a policy run recompile on the first GPU runs.
    assert lines[-2] == (
        "decode-step instances over 7 storage states: _partial_kernel 1, _combine_kernel 1, _score_kernel 1"
    )
    compiled = [line.split()[0] for line in lines[:-2]]
    assert int(lines[-1].split()[0]) == len(compiled) > 20
    for name in KERNELS:
        assert name in compiled


def test_aot_check_refuses_the_interpreter(monkeypatch):
    from eval.gpu.aot import representative_calls

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="without TRITON_INTERPRET"):
        representative_calls()


@pytest.mark.slow
def test_kernel_sass_reads_the_partial_pass_machine_code(tmp_path):
    """eval/kernel_sass.py (registers, spills and the loop's instructions of the sm_90 code, no GPU): the integer
    pieces read keeps its codes out of two-byte shared-memory stores and costs fewer instructions per slot than
    the rows read it replaced, the reason it is the default (docs/kernels.md, the H100 lease); the fp16 form
    cuts the loop again; a register cap reaches the compiler (three programs an SM where there were two); column
    sums of the softmax denominators take barriers out of the loop."""
    import json

    from hfkv.kernels.environment import triton_version

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sass.json"
    cmd = [  # as documented: a module of the eval package, from the repository root
        sys.executable,
        "-m",
        "eval.kernel_sass",
        "--kinds",
        "quant",
        "--launch",
        "",
        "--launch",
        "half_dequant=0",
        "--launch",
        "int_pieces=0",
        "--launch",
        "max_registers=80",
        "--launch",
        "column_sums=0",
        "--launch",
        "operand_fence=1;asm_dequant=0",
        "--launch",
        "operand_fence=0;asm_dequant=0",
        "--launch",
        "asm_dequant=0",
        "--launch",
        "spread_banks=0",
        "--launch",
        "code_dots=3",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows_out = json.loads(out.read_text())["rows"]
    half, pieces, rows, capped, row_sums, fenced, unfenced, no_asm, unspread, codes = rows_out
    for r in (half, pieces, rows, capped, row_sums, fenced, unfenced, no_asm, unspread, codes):
        assert 0 < r["registers"] <= 255 and r["loop_instructions"] > 100 and r["loop_families"]["HMMA"] > 0
        assert r["loops_instructions"] == [r["loop_instructions"]]  # one part (K int4 / V int2 pages), one loop
    assert pieces["loop_ops"].get("STS.U16", 0) == 0 < rows["loop_ops"].get("STS.U16", 0)
    assert pieces["loop_warp_instructions_per_slot"] < rows["loop_warp_instructions_per_slot"]
    # the fp16 dequantization (the default): pairs of elements per HADD2 / HFMA2, no int -> fp32 conversion, fewer
    # instructions (docs/kernels.md: 7% fewer with Triton 3.6, 20% with 3.9, which also moves the tiles by ldmatrix)
    assert half["loop_ops"].get("HFMA2", 0) > 0 and half["loop_ops"].get("I2FP.F32.U32", 0) == 0
    assert pieces["loop_ops"].get("HFMA2", 0) == 0 < pieces["loop_ops"].get("I2FP.F32.U32", 0)
    assert half["loop_instructions"] < 0.95 * pieces["loop_instructions"]
    assert half["registers"] > 80 >= capped["registers"]
    assert capped["launch"] == {"max_registers": 80}
    # the softmax denominators summed per column: one cross-warp reduction an iteration fewer than row sums
    bars = half["loop_families"]["BAR"]
    assert bars < row_sums["loop_families"]["BAR"] and half["loop_instructions"] < row_sums["loop_instructions"]
    # the operand fence reaches the compiled code (one identity per product) and the products take the tensor cores'
    # pairs (kWidth 2); without it Triton 3.6 and 3.7 gave width 4 (docs/kernels.md: 69.9 -> 59.0 warp-instructions a
    # slot with 3.6); this suite's Triton picks 2 unaided from 3.8 on, so the default follows the version
    assert fenced["inline_asm_ops"] == 2 and unfenced["inline_asm_ops"] == 0
    assert fenced["dot_operand_kwidths"] == [2]
    assert no_asm["inline_asm_ops"] == (2 if triton_version() < (3, 8) else 0)
    # the fp16 form's arithmetic as PTX (the default): one lop3 and two f16x2 operations a pair of codes, where Triton's
    # own code left pairs' operations on one lane and repacked the rest (docs/kernels.md: 60.9 -> 44.4 with Triton 3.6)
    assert half["inline_asm_ops"] > no_asm["inline_asm_ops"]
    assert half["loop_instructions"] < 0.9 * no_asm["loop_instructions"]
    assert half["loop_ops"].get("PRMT", 0) < no_asm["loop_ops"].get("PRMT", 0)
    # the integer tiles' columns ordered for the shared-memory stores (the default): lane 0 of each tile handed to
    # shared memory tells apart columns 32 apart, not 64, so a quarter-warp's 16-byte stores meet every bank group
    # once (docs/kernels.md, thirteenth lease: 8 wavefronts a store where 4 would do on the H200)
    assert half["tile_lane_columns"] and all(lanes[0] == 32 for lanes in half["tile_lane_columns"])
    assert unspread["tile_lane_columns"] and all(lanes[0] == 64 for lanes in unspread["tile_lane_columns"])
    # products from codes: no BLOCK_N x D fp16 tile stored to shared memory (the default stores one per product), the
    # code bytes copied there asynchronously instead (the page table one ahead, their default), one conversion each
    block = f"{64}x{128}xf16"  # kernel_sass compiles Llama's head_dim at the default block of 64 slots
    assert half["shared_tiles"]["stored"].count(block) == 2 and not half["shared_tiles"]["async_copied"]
    assert block not in codes["shared_tiles"]["stored"]
    assert any(t.endswith("xi8") for t in codes["shared_tiles"]["async_copied"])
    assert codes["inline_asm_ops"] > 0 and codes["loop_families"]["HMMA"] == half["loop_families"]["HMMA"]


def test_kernel_sass_counts_shared_memory_requests():
    """``shared_bytes``: a warp's shared-memory requests in a loop, from SASS text: 32 lanes times an instruction's
    width, 128 bytes a matrix for ``ldmatrix`` / ``stmatrix``, an asynchronous copy's write a store, the placeholders
    predicated off (``@!PT``) not at all."""
    from eval import kernel_sass as ks

    loop = [
        "LDSM.16.M88.4 R8, [R44]",  # 4 matrices: 512
        "LDSM.16.MT88.2 R1, [R2]",  # 256
        "LDSM.16.MT88 R3, [R2]",  # no count: one matrix, 128 (Triton 3.9's code has these)
        "LDS.64 R1, [R2]",  # 256
        "LDS.U8 R1, [R2]",  # 32
        "@P0 LDS R1, [R2]",  # predicated on a register: may run, 128
        "@!PT LDS RZ, [RZ]",  # never runs
        "STS.128 [R1], R4",  # 512
        "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]",  # 512
        "STSM.16.M88.4 [R1], R4",  # 512
        "HMMA.16816.F32 R24, R24, R22, RZ",
    ]
    assert ks.shared_bytes(loop) == {"loaded": 512 + 256 + 128 + 256 + 32 + 128, "stored": 3 * 512}
