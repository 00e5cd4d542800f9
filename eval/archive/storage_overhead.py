"""Bytes held with nothing to evict: ``evict`` with a budget above the length against DynamicCache.

What a paged cache costs beyond its payload (tags and scores in the records, the window ring's
empty slots, the zero page, page tails), measured from the tensors held after ``generate``
(docs/architecture.md, "Memory"):

    python -m eval.archive.storage_overhead --model smollm2 --dtype bf16 --lengths 256,1064,2048 \
        --out eval/archive/results/storage_overhead_smollm2.json    # the committed file; without --out: hfkv-out/eval/

Archived (eval/archive/README.md): its answer is docs/architecture.md, "Memory" (SmolLM2 1.039x DynamicCache at
1,064 tokens), and tests/test_cache.py checks the same cost on every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch
from transformers import DynamicCache

import hfkv
from hfkv.storage import dynamic_cache_bytes

OUT_DIR = Path("hfkv-out/eval")  # a run's default folder, under the working directory; the committed one only by --out


@torch.inference_mode()
def overhead(model, length: int, new_tokens: int) -> dict:
    """Held bytes of ``evict`` (budget 2x the length) and DynamicCache after the same greedy run."""
    ids = torch.randint(
        3, model.config.vocab_size, (1, length - new_tokens), generator=torch.Generator().manual_seed(0)
    )
    sizes = {}
    for name in ("dynamic", "evict"):
        cache = (
            DynamicCache(config=model.config)
            if name == "dynamic"
            else hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset("evict", budget=2 * length))
        )
        model.generate(
            ids, past_key_values=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
        sizes[name] = dynamic_cache_bytes(cache) if name == "dynamic" else cache.stats().kv_bytes
    return {"tokens": length, **sizes, "ratio": sizes["evict"] / sizes["dynamic"]}


def out_path(args: argparse.Namespace) -> Path:
    """``--out``, or the default file of ``--model`` under the working directory."""
    return Path(args.out) if args.out else OUT_DIR / f"storage_overhead_{args.model}.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--lengths", default="256,1064,2048", help="tokens held at the end (prompt + 40 new)")
    ap.add_argument("--out", default=None, help=f"JSON file (default {OUT_DIR}/storage_overhead_<model>.json)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hfkv.atomic import write_atomic
    from hfkv.loading import load_model

    torch.set_num_threads(1)
    model, _ = load_model(args.model, dtype=args.dtype)
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        r = overhead(model, n, 40)
        rows.append(r)
        print(f"{n:6d} tokens: evict {r['evict']:,} B / DynamicCache {r['dynamic']:,} B = {r['ratio']:.4f}")
    meta = {"model": args.model, "dtype": args.dtype, "hfkv": hfkv.__version__, "machine": platform.machine()}
    out = out_path(args)
    write_atomic(out, json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
