"""The PTX of the fp16 dequantization (``half_pair_asm``) and of the codes' conversion (``code_pair_asm``), run by an
emulator of the instructions they use.

The interpreter runs no inline assembly, so the kernel tests on a CPU run the same arithmetic written in Triton;
this checks the assembly text itself: for every code width, each 16-bit lane of a register comes out as
``code * scale + zero`` rounded once to fp16, where ``code`` is that lane's low bits, whatever the other lane
and the bits above the code hold. The compiled kernel tests on a GPU run it inside the kernel.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from hfkv.kernels.code_products import code_pair_asm
from hfkv.kernels.dequant import half_pair_asm


def _f16x2(word: int) -> tuple[np.float16, np.float16]:
    lanes = np.array([word & 0xFFFF, word >> 16], dtype=np.uint16)
    return tuple(lanes.view(np.float16))


def _word(lo: float, hi: float) -> int:
    bits = np.array([lo, hi], dtype=np.float16).view(np.uint16).astype(np.int64)
    return int(bits[0]) | int(bits[1]) << 16


def _operand(text: str, regs: dict[str, int]) -> int:
    text = text.strip()
    return regs[text] if text in regs else int(text, 0)


def run_ptx(asm: str, inputs: list[int], outputs: int = 1) -> int | tuple[int, ...]:
    """Run ``asm`` (Triton's ``$0 .. $outputs-1`` outputs, then the 32-bit inputs) with the semantics of the PTX ISA:
    ``lop3.b32`` evaluates its look-up table bit by bit (a, b, c select bits 4, 2, 1 of the index), ``prmt.b32`` picks
    each result byte by a selector nibble from the eight bytes of ``b:a`` (the nibble's bit 3 replicates the byte's
    sign), the f16x2 operations work lane by lane, ``fma.rn`` rounds the exact ``a * b + c`` once (float64 holds the
    inputs used here exactly). One output: its value; several: a tuple."""
    regs = {f"${i + outputs}": v for i, v in enumerate(inputs)}
    body = asm.strip().strip("{}")
    for stmt in (s.strip() for s in body.split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        if op == "mov.b32":
            regs[dst] = _operand(src[0], regs) & 0xFFFFFFFF
        elif op == "lop3.b32":
            a, b, c, lut = (_operand(x, regs) for x in src)
            out = 0
            for bit in range(32):
                idx = ((a >> bit) & 1) << 2 | ((b >> bit) & 1) << 1 | ((c >> bit) & 1)
                out |= ((lut >> idx) & 1) << bit
            regs[dst] = out
        elif op == "prmt.b32":
            a, b, sel = (_operand(x, regs) for x in src)
            pool = (a & 0xFFFFFFFF) | (b & 0xFFFFFFFF) << 32
            out = 0
            for i in range(4):
                nib = (sel >> (4 * i)) & 0xF
                byte = (pool >> (8 * (nib & 7))) & 0xFF
                if nib & 8:
                    byte = 0xFF if byte & 0x80 else 0
                out |= byte << (8 * i)
            regs[dst] = out
        elif op == "sub.f16x2":
            a, b = (_f16x2(_operand(x, regs)) for x in src)
            regs[dst] = _word(*(np.float16(np.float64(x) - np.float64(y)) for x, y in zip(a, b, strict=True)))
        elif op == "fma.rn.f16x2":
            a, b, c = (_f16x2(_operand(x, regs)) for x in src)
            lanes = (np.float16(np.float64(x) * np.float64(y) + np.float64(z)) for x, y, z in zip(a, b, c, strict=True))
            regs[dst] = _word(*lanes)
        else:
            raise AssertionError(f"instruction {op!r} is not emulated: extend run_ptx before using it")
    return regs["$0"] if outputs == 1 else tuple(regs[f"${i}"] for i in range(outputs))


@pytest.mark.parametrize("bits,shift", [(2, 0), (2, 2), (2, 4), (2, 6), (4, 0), (4, 4), (8, 0)])  # every plane read
def test_half_pair_asm_gives_each_lane_its_code_times_scale_plus_zero(bits, shift):
    rng = np.random.default_rng(bits * 8 + shift)
    asm = half_pair_asm(bits, shift)
    assert re.search(r"\$0\b", asm) and "$4" not in asm  # one output, three inputs (lanes, scales, zeros)
    for _ in range(200):
        word = int(rng.integers(0, 2**32))  # the bits around each lane's code are anything
        scale = rng.uniform(1e-3, 2.0, 2).astype(np.float16) * rng.choice([-1, 1], 2).astype(np.float16)
        zero = rng.uniform(-4.0, 4.0, 2).astype(np.float16)
        out = _f16x2(run_ptx(asm, [word, _word(*scale), _word(*zero)]))
        for lane, got in enumerate(out):
            code = (word >> (16 * lane + shift)) & ((1 << bits) - 1)
            want = np.float16(code * np.float64(scale[lane]) + np.float64(zero[lane]))
            assert got == want, (bits, shift, hex(word), lane, got, want)


def test_half_pair_asm_refuses_a_plane_past_its_byte():
    with pytest.raises(ValueError, match="bits=4 from shift=6"):
        half_pair_asm(4, 6)


def test_run_ptx_refuses_what_it_does_not_emulate():
    with pytest.raises(AssertionError, match="add.s32"):
        run_ptx("{ add.s32 $0, $1, $2; }", [1, 2])


@pytest.mark.parametrize("bits,shift", [(2, 0), (2, 2), (2, 4), (2, 6), (4, 0), (4, 4), (8, 0)])  # every plane read
def test_code_pair_asm_gives_each_byte_its_code(bits, shift):
    """Four bytes in, four fp16 out (two registers, bytes 0-1 then 2-3): each exactly the byte's code, its plane at
    ``shift``, whatever the byte's other bits."""
    rng = np.random.default_rng(bits * 8 + shift + 1)
    asm = code_pair_asm(bits, shift)
    assert re.search(r"\$1\b", asm) and re.search(r"\$2\b", asm) and "$3" not in asm  # two outputs, one input
    for _ in range(200):
        word = int(rng.integers(0, 2**32))
        lo, hi = run_ptx(asm, [word], outputs=2)
        got = [*_f16x2(lo), *_f16x2(hi)]
        for i in range(4):
            code = (word >> (8 * i + shift)) & ((1 << bits) - 1)
            assert got[i] == np.float16(code), (bits, shift, hex(word), i, got[i])


def test_code_pair_asm_refuses_a_plane_past_its_byte():
    with pytest.raises(ValueError, match="bits=2 from shift=7"):
        code_pair_asm(2, 7)
