"""Launch shapes of the Triton encode (``encode_write``) on a prompt-sized write, timed on the device.

A prompt's tier writes are one ``encode_write`` per tier of ~500k tokens a layer at 8k x 8 (Llama-3.1-8B
shape: 8 KV heads x 128), one program of 128 threads per token by default; on an H200 they took ~3 ms
of a layer's prefill (docs/kernels.md, "Runs on a GPU"). This sweeps tokens per program and warps for
the tier formats of the ``hfkv`` preset, each against the default, and names the fastest.

    python eval/encode_bench.py --out DIR             # a CUDA machine: ~2 minutes (16-token programs compile slowly)
    python eval/encode_bench.py --out DIR --dry-run   # a CPU: Triton's interpreter, toy sizes

Writes ``DIR/encode_bench.json`` after each format (a run stopped from outside keeps the formats it finished): per
format the default's and each shape's milliseconds (median of ``--repeats`` calls, CUDA events), and bytes
written per second.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from hfkv.atomic import write_atomic  # noqa: E402

FORMATS = (("model", "model"), ("int8", "int4"), ("int4", "int2"))  # hfkv's tiers: original, K8V4, K4V2


def _case(key: str, value: str, n: int, dim: int, device: str):
    from hfkv.quant.formats import QuantFormat
    from hfkv.quant.record import RecordLayout
    from hfkv.storage.paged import auto_page_bytes

    lay = RecordLayout(QuantFormat(key, dim, 32, torch.bfloat16), QuantFormat(value, dim, 32, torch.bfloat16))
    page_bytes = auto_page_bytes([lay.nbytes])
    tpp = lay.records_per_page(page_bytes)
    pages = -(-n // tpp)
    pool = torch.zeros(pages, page_bytes, dtype=torch.uint8, device=device)
    slot = torch.arange(n, device=device)
    dest = (slot // tpp) * page_bytes + (slot % tpp) * lay.stride
    g = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(n, dim, generator=g).to(device, torch.bfloat16)
    v = torch.randn(n, dim, generator=g).to(device, torch.bfloat16)
    pos = torch.arange(n, device=device)
    score = torch.rand(n, generator=g).to(device)
    return lay, pool, dest, k, v, pos, score  # encode_write's arguments after the layout: k, v, pos, score


def _time(fn, repeats: int, cuda: bool) -> float:
    fn()  # compile
    times = []
    for _ in range(repeats):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            import time

            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, toy sizes")
    p.add_argument("--tokens", type=int, default=None, help="tokens per write (default 524288; dry run 40)")
    p.add_argument("--rows", default="1,4,16", help="tokens per program to try (default 1,4,16)")
    p.add_argument("--warps", default="1,4", help="warps per program to try (default 1,4)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per shape (default 10; dry run 1)")
    args = p.parse_args(argv)
    from hfkv.kernels.encode import ENCODE_ROWS, ENCODE_ROWS_MODEL, ENCODE_WARPS, encode_write

    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        print("encode_bench: no CUDA device (use --dry-run on a CPU)", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    n = args.tokens or (524288 if cuda else 40)
    repeats = args.repeats or (10 if cuda else 1)
    shapes = [(int(r), int(w)) for r in args.rows.split(",") for w in args.warps.split(",")]
    result: dict = {
        "what": "encode_write launch shapes (eval/encode_bench.py)",
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
        "tokens": n,
        "head_dim": 128,
        "default": {"rows_model": ENCODE_ROWS_MODEL, "rows": ENCODE_ROWS, "warps": ENCODE_WARPS},
        "formats": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for key, value in FORMATS:
        case = _case(key, value, n, 128 if cuda else 32, device)
        lay = case[0]
        row: dict = {"key": key, "value": value, "record_bytes": lay.nbytes, "shapes": []}
        for rows, warps in shapes:
            ms = _time(functools.partial(encode_write, case[1], case[2], lay, *case[3:], rows, warps), repeats, cuda)
            row["shapes"].append({"rows": rows, "warps": warps, "ms": ms, "write_gb_s": n * lay.nbytes / ms / 1e6})
            print(f"{key}/{value} rows {rows:>2} warps {warps}: {ms:8.3f} ms", flush=True)
        own = ENCODE_ROWS_MODEL if key == value == "model" else ENCODE_ROWS
        default = next((s for s in row["shapes"] if (s["rows"], s["warps"]) == (own, ENCODE_WARPS)), None)
        best = min(row["shapes"], key=lambda s: s["ms"])
        row["fastest"] = best
        row["speedup_over_default"] = default["ms"] / best["ms"] if default else None
        result["formats"].append(row)
        write_atomic(args.out / "encode_bench.json", json.dumps(result, indent=1))  # a run cut short keeps these
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
