"""Where a CPU decode step spends its time, per section, at a long context.

The model and context of eval/cpu_cache_figures.py (random Llama, 8 layers, 2 KV heads x 64, fp32,
8k tokens, one thread). Sections are timed by wrapping the methods that implement them (wall time,
summed over layers, averaged over the timed steps; policy runs included at their share):

- ``read_slots``: the page gather of each tier (``PagedTiers.read_slots``);
- ``decode_kv_for_attention``: reading keys and values out of the records (integer fields unpacked);
- ``slot_attention_received``: logits, joint softmax, output and the scores' GQA reduction over every part;
- ``add_scores``: the received attention written back into the records;
- ``paged_attention_cpu``: the CPU kernel, which does all four above in one call (``backend='cpu'``, what
  ``auto`` picks on a CPU; the four sections above are the torch backend's);
- ``run_policy``: re-classification and moves (every ``interval`` steps).

    python eval/cpu_step_sections.py --wait-quiet 900 --specs hfkv@1024 hfkv@1024:backend=torch evict@1024 \
        --out eval/results/cpu_step_sections.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hfkv.cache
import hfkv.kernels.cpu.paged_decode
import hfkv.storage.paged
import hfkv.storage.record
from hfkv.atomic import write_atomic
from hfkv.evaluation import quiet
from hfkv.evaluation.bench import decode_step, fill_cache, random_prompt
from hfkv.evaluation.methods import parse_method
from hfkv.evaluation.shapes import build_random_like

SECTIONS: list[tuple[Any, str]] = [
    (hfkv.storage.paged.PagedTiers, "read_slots"),
    (hfkv.storage.record.RecordLayout, "decode_kv_for_attention"),
    (hfkv.cache, "slot_attention_received"),
    (hfkv.storage.paged.PagedTiers, "add_scores"),
    (hfkv.kernels.cpu.paged_decode, "paged_attention_cpu"),
    (hfkv.cache.TriStateLayer, "run_policy"),
]


def _timed(fn: Callable, name: str, spent: Counter) -> Callable:
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t0

    return wrapper


@torch.inference_mode()
def measure(spec: str, context: int, steps: int, warmup: int = 8) -> dict[str, float]:
    """Milliseconds per decode step: ``step`` in all, and per section."""
    model = build_random_like("cpu-small", max_positions=16384)  # the model of eval/cpu_cache_figures.py
    cache = parse_method(spec).make_cache(model)
    fill_cache(model, cache, random_prompt(model.config.vocab_size, 1, context), 1024)
    tok, pos = torch.zeros(1, 1, dtype=torch.long), context
    for _ in range(warmup):
        decode_step(model, cache, tok, pos)
        pos += 1
    spent: Counter = Counter()
    saved = [(owner, name, getattr(owner, name)) for owner, name in SECTIONS]
    for owner, name, fn in saved:
        setattr(owner, name, _timed(fn, name, spent))
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            decode_step(model, cache, tok, pos)
            pos += 1
        total = time.perf_counter() - t0
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return {"step": total / steps * 1e3} | {name: spent[name] / steps * 1e3 for _, name in SECTIONS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--specs", nargs="+", default=["hfkv@1024", "hfkv@1024:backend=torch", "evict@1024"], help="method specs"
    )
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=32, help="timed steps (a multiple of the policy interval)")
    ap.add_argument("--out", type=Path, default=Path("eval/results/cpu_step_sections.json"))
    quiet.add_arguments(ap, default_threads="1")  # --threads, --max-load, --wait-quiet, --force-busy
    args = ap.parse_args(argv)
    if len(args.threads) != 1:  # one file holds one thread count's sections
        ap.error(f"--threads={','.join(map(str, args.threads))}: one thread count per run (run once per count)")
    threads = args.threads[0]
    try:
        record = quiet.start([threads], args.max_load, args.wait_quiet, args.force_busy)
    except quiet.BusyMachine as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(threads)
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {threads} torch thread(s)",
        "torch": torch.__version__,
        "context": args.context,
        "steps": args.steps,
        "quiet": record,
        "ms_per_step": {},
    }
    for spec in args.specs:
        ms = measure(spec, args.context, args.steps)
        result["ms_per_step"][spec] = ms
        print(spec, "  ".join(f"{k} {v:.2f}" for k, v in ms.items()), "(ms/step)", flush=True)
    quiet.finish(record)
    result["busy"] = record["busy"]
    write_atomic(args.out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
