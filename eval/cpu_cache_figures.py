"""CPU figures for TriStateCache vs DynamicCache, in one process, reported as ratios.

Model: random-weight Llama, 8 layers, hidden 512, 8 heads, 2 KV heads (head_dim 64), fp32.
1. Memory: a 2k-token prompt + 256 generated tokens per preset -> kv_bytes and compression ratio.
2. Decode step time at a long context (default 8k) for ``hfkv`` (budget 1024) vs DynamicCache, with
   the memory each timed cache holds at the end (a speed figure means little without its memory).
3. Decode step time at a short context (<= budget) -> hfkv's overhead; ``evict`` alongside, which
   at short context compresses nothing, to separate the cost of paging from that of dequantizing.

The interleaved timing is ``hfkv.evaluation.bench.interleaved_decode_times`` (what ``hfkv bench`` uses);
``hfkv bench --random-like cpu-small`` measures the same model over more contexts, methods and batches.

    python eval/cpu_cache_figures.py      # writes hfkv-out/eval/cpu_cache_figures.json under the working directory
    python eval/cpu_cache_figures.py --out eval/results/cpu_cache_figures.json      # regenerates the committed file

Timing only on a quiet machine (``hfkv.evaluation.quiet``, docs/bench.md "Timing honestly"): refused
unless the 1-minute load average is below ``--max-load`` (``--wait-quiet S``, ``--force-busy``); the decode
sections are timed at each of ``--threads`` (default ``1,all``), each its own entry of ``timings``; the
file records the thread counts, ``os.cpu_count()`` and the loads before and after (``quiet``), and
``busy`` when either end was not quiet.

``--timed`` takes presets or method specs separated by commas, or by semicolons when a spec has
overrides of its own (``--timed "hfkv;hfkv@1024:budget_unit=tokens,window=32"``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import hfkv
from hfkv.atomic import write_atomic
from hfkv.evaluation import quiet
from hfkv.evaluation.bench import interleaved_decode_times
from hfkv.evaluation.methods import parse_method
from hfkv.evaluation.results import provenance
from hfkv.evaluation.shapes import build_random_like
from hfkv.storage import dynamic_cache_bytes

PRESETS = ["evict", "quant", "streaming", "arkv", "diffkv", "hfkv"]
OUT_DIR = Path("hfkv-out/eval")  # a run's default folder, under the working directory; eval/results/ only by --out


def split_timed(text: str) -> list[str]:
    """``--timed``: semicolons separate specs when any is given (specs' overrides use commas), else commas."""
    return [t.strip() for t in text.split(";" if ";" in text else ",") if t.strip()]


def held_fraction(cache) -> float | None:
    """KV bytes held / DynamicCache's for the same tokens (None for DynamicCache itself)."""
    if not isinstance(cache, hfkv.TriStateCache):
        return None
    st = cache.stats()
    return st.kv_bytes / st.dense_bytes


def build_model(seed: int = 0, context: int = 8192):
    """The shape `hfkv bench` names, with positions for ``context`` tokens and the decode steps after them."""
    return build_random_like("cpu-small", max_positions=max(16384, context + 1024), seed=seed)


def make_cache(model, name: str, budget: int):
    """A preset at ``budget``, or any method spec of hfkv.evaluation.methods (``hfkv@1024:budget_unit=tokens``)."""
    if name == "dynamic":
        return DynamicCache(config=model.config)
    if "@" in name or ":" in name:
        return parse_method(name).make_cache(model)
    return hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset(name, budget=budget))


@torch.inference_mode()
def memory_table(model, prompt_len: int, new_tokens: int, budget: int) -> list[dict]:
    ids = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    rows = []
    for name in ["dynamic", *PRESETS]:
        kw = {} if name in ("dynamic", "quant", "diffkv") else {"budget": budget}
        cache = (
            DynamicCache(config=model.config)
            if name == "dynamic"
            else hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset(name, **kw))
        )
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, do_sample=False, past_key_values=cache)
        secs = time.perf_counter() - t0
        if name == "dynamic":
            kv = dense = dynamic_cache_bytes(cache)
        else:
            st = cache.stats()
            kv, dense = st.kv_bytes, st.dense_bytes
        rows.append(
            {
                "cache": name,
                "budget": kw.get("budget"),
                "kv_bytes": kv,
                "dense_bytes": dense,
                "compression_ratio": dense / kv,
                "generate_s": round(secs, 2),
            }
        )
        print(f"  {name:>9}: kv_bytes={kv:>12,} ratio={dense / kv:6.2f}x generate={secs:6.1f}s", flush=True)
    return rows


def decode_section(model, ctx: int, timed: list[str], budget: int, steps: int) -> dict:
    """Every cache of ``timed`` against a DynamicCache at ``ctx``, interleaved step by step."""
    caches = {"dynamic": make_cache(model, "dynamic", budget)}
    caches.update({name: make_cache(model, name, budget) for name in timed})
    times = interleaved_decode_times(model, caches, ctx, steps)
    dyn, dyn_mean = times["dynamic"]
    entry = {"context": ctx, "dynamic_ms_median": dyn * 1e3, "dynamic_ms_mean": dyn_mean * 1e3}
    for name in timed:
        med, mean = times[name]
        spec_budget = budget if "@" not in name else name.split("@")[1].split(":")[0]
        entry[name] = {
            "budget": spec_budget,
            "ms_median": med * 1e3,
            "ms_mean": mean * 1e3,  # over every timed step: the policy runs included
            "speedup_median": dyn / med,
            "speedup_mean": dyn_mean / mean,
            "memory_fraction": held_fraction(caches[name]),
        }
        print(
            f"decode @ {ctx}, {torch.get_num_threads()} thread(s): DynamicCache {dyn * 1e3:.2f} ms/step "
            f"(mean {dyn_mean * 1e3:.2f}), {name} (budget {spec_budget}) {med * 1e3:.2f} ms/step "
            f"(mean {mean * 1e3:.2f}) -> {dyn / med:.2f}x median, {dyn_mean / mean:.2f}x mean",
            flush=True,
        )
    return entry


def write_json(path: Path, result: dict) -> None:
    write_atomic(path, json.dumps(result, indent=2))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--long-context", type=int, default=8192)
    ap.add_argument("--short-context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--timed", default="hfkv,evict", help="presets or method specs timed vs DynamicCache")
    ap.add_argument("--skip-memory", action="store_true")
    quiet.add_arguments(ap)  # --threads (default 1,all), --max-load, --wait-quiet, --force-busy
    ap.add_argument("--out", type=Path, default=OUT_DIR / "cpu_cache_figures.json", help="default: %(default)s")
    args = ap.parse_args(argv)
    try:
        record = quiet.start(args.threads, args.max_load, args.wait_quiet, args.force_busy)
    except quiet.BusyMachine as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if record["busy"]:
        print(f"warning: busy machine ({quiet.describe(record)}); the result is marked busy", file=sys.stderr)
    model = build_model(context=max(args.long_context, args.short_context) + args.steps)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "quiet": record,  # completed after the last timed step
        "busy": record["busy"],
        "timings": [],
    }
    torch_threads = torch.get_num_threads()
    timed = split_timed(args.timed)
    try:
        if not args.skip_memory:
            torch.set_num_threads(args.threads[0])
            print(f"memory: prompt {args.prompt} + {args.new_tokens} new tokens")
            result["memory"] = memory_table(model, args.prompt, args.new_tokens, args.budget)
            result["memory_threads"] = args.threads[0]
        for n in args.threads:  # each thread count its own section, every cache against DynamicCache
            torch.set_num_threads(n)
            section = {"threads": n}
            for label, ctx in (("long", args.long_context), ("short", args.short_context)):
                section[f"decode_{label}"] = decode_section(model, ctx, timed, args.budget, args.steps)
            result["timings"].append(section)
            write_json(args.out, result)
    finally:
        torch.set_num_threads(torch_threads)
    print("waiting for the run's own load to decay", flush=True)
    quiet.finish(record)
    # commit, dirty flag and a digest of hfkv's sources: which code a figure measured
    result |= {k: v for k, v in provenance().items() if k not in result}
    result["busy"] = record["busy"]
    if record["busy"]:
        print(f"busy machine ({quiet.describe(record)}): the result is marked busy, not a result")
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
