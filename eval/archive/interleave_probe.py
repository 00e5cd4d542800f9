"""Why does DynamicCache's decode step slow down when another cache steps in turns with it?

gpu_check run 12 (H200, every step timed between two device synchronisations) put DynamicCache's step at
23.2 ms alone and 62.8 ms in turns with two hfkv caches (8k x 8, random Llama-3.1-8B), while hfkv's
moved from 26.5 to 28.4 ms: the "in turns" ratios, taken as the ones to trust, are inflated by
whatever the turns do to DynamicCache. This probe separates the candidates on one device call:

* ``alone``: each cache's steps with the other kept alive but idle;
* ``turns``: the two in turns (as gpu_check does);
* ``turns_gc_off``: the same with Python's garbage collector disabled;
* ``blocks``: the two in blocks of ``--block`` steps (A x block, B x block, ...);

and per step the caching allocator's device allocations and frees (``num_device_alloc`` /
``num_device_free``: each a cudaMalloc / cudaFree, which synchronise) and its retries, plus a
``torch.profiler`` table of one round in turns. Nothing is asserted: evidence for the bench's design.

    python -m eval.archive.interleave_probe --out DIR             # a CUDA machine: Llama-3.1-8B shape, 8k x 8
    python -m eval.archive.interleave_probe --out DIR --dry-run   # a CPU: the small shape, seconds

Archived (eval/archive/README.md): it answered its question on the tenth lease (docs/kernels.md, "Runs on a GPU":
cuDNN attention plans every new key length on the host), which is why the GPU check and ``hfkv bench`` limit
DynamicCache's SDPA to flash, efficient and math (``hfkv.evaluation.bench.BASELINE_SDPA``). Its results:
``eval/archive/results/interleave_probe_h200_default_sdpa*.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from hfkv.atomic import write_atomic
from hfkv.evaluation.bench import Clock, decode_step, fill_cache, random_prompt, sdpa_backends
from hfkv.evaluation.methods import parse_method
from hfkv.evaluation.shapes import build_random_like

COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _counters(cuda: bool) -> dict[str, int]:
    if not cuda:
        return dict.fromkeys(COUNTERS, 0)
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in COUNTERS}


class Live:
    """A prefilled cache that goes on decoding from where it stopped."""

    def __init__(self, model, method, ids: torch.Tensor, extra: int):
        self.name = method.label
        self.cache = method.make_cache(model, max_cache_len=ids.shape[1] + extra + 1)
        self.tok = fill_cache(model, self.cache, ids)
        self.pos = ids.shape[1]

    def step(self, model) -> None:
        self.tok = decode_step(model, self.cache, self.tok, self.pos)
        self.pos += 1


def timed(model, live: Live, clock: Clock, cuda: bool, log: dict) -> None:
    before = _counters(cuda)
    t = clock.start()
    live.step(model)
    times: list[float] = []
    clock.stop(t, times)
    after = _counters(cuda)
    log.setdefault(live.name, []).append({"ms": 1e3 * times[0], **{k: after[k] - before[k] for k in COUNTERS}})


def summary(log: dict) -> dict:
    out = {}
    for name, steps in log.items():
        ms = [s["ms"] for s in steps]
        out[name] = {
            "steps": len(steps),
            "ms_median": statistics.median(ms),
            "ms_mean": statistics.fmean(ms),
            "ms": [round(x, 3) for x in ms],
            **{f"{k}_per_step": sum(s[k] for s in steps) / len(steps) for k in COUNTERS},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--method", default="hfkv@1024:backend=triton")
    p.add_argument("--sdpa", default="default", help="torch SDPA backends (bench.sdpa_backends); default: torch's")
    args = p.parse_args(argv)
    with sdpa_backends(args.sdpa):
        return probe(args)


def probe(args) -> int:
    cuda = not args.dry_run and torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    context = args.context or (8192 if cuda else 256)
    batch = args.batch or (8 if cuda else 2)
    shape, layers = ("llama-3.1-8b", 32) if cuda else ("cpu-small", 2)
    dtype = torch.bfloat16 if cuda else torch.float32
    method = args.method if cuda else args.method.replace(":backend=triton", "")
    model = build_random_like(shape, layers, dtype, device, context + 64 * args.steps + 256)
    ids = random_prompt(model.config.vocab_size, batch, context).to(device)
    extra = 64 * args.steps + 128
    hf, dyn = (Live(model, parse_method(m), ids, extra) for m in (method, "dynamic"))
    for _ in range(12):  # past hfkv's first policy run (it compiles kernels once)
        hf.step(model)
        dyn.step(model)
    clock = Clock(device, synced=True)
    result: dict = {
        "what": "DynamicCache's decode step alone and in turns with an hfkv cache",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "shape": shape, "layers": layers, "context": context, "batch": batch, "method": method, "sdpa": args.sdpa,
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        write_atomic(out / "interleave_probe.json", json.dumps(result, indent=1))

    for section in ("alone", "turns", "turns_gc_off", "blocks", "alone_again"):
        log: dict = {}
        if section == "turns_gc_off":
            gc.collect()
            gc.disable()
        if section.startswith("alone"):
            order = [dyn] * args.steps + [hf] * args.steps
        elif section.startswith("turns"):
            order = [dyn, hf] * args.steps
        else:
            rounds = max(1, args.steps // args.block)
            order = ([dyn] * args.block + [hf] * args.block) * rounds
        for live in order:
            timed(model, live, clock, cuda, log)
        gc.enable()
        result[section] = summary(log)
        save()
        print(section, {k: (round(v["ms_median"], 2), round(v["ms_mean"], 2), v["num_device_alloc_per_step"])
                        for k, v in result[section].items()}, flush=True)  # fmt: skip
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                dyn.step(model)
                hf.step(model)
            torch.cuda.synchronize()
        result["profile_turns"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                dyn.step(model)
            torch.cuda.synchronize()
        result["profile_dynamic_alone"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        save()
        print(result["profile_turns"][:6000])
        print(result["profile_dynamic_alone"][:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
