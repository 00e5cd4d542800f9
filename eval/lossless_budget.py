"""Is a cache whose budget covers the sequence the full cache? SmolLM2 on a human-written document, greedy.

While everything held fits the budget, hfkv holds the sequence as DynamicCache does and attends with the model's
SDPA (docs/generate.md, "A budget that covers the sequence"). This script checks what a user sees: the generated
tokens against DynamicCache's, the tiers the cache holds and its bytes against DynamicCache's.

bf16 needs a yardstick. Attention computed by another kernel rounds differently in bf16, and greedy text can part
at a near-tie for that alone: transformers' own ``eager`` and ``sdpa`` attention, both with DynamicCache, are run
on the same prompt, and the first token where they part is recorded beside hfkv's.

    OMP_NUM_THREADS=2 python eval/lossless_budget.py --out eval/results/lossless_budget.json  # the committed file
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# a run's default output, under the working directory; the committed eval/results/ only by --out
DEFAULT_OUT = Path("hfkv-out/eval/lossless_budget.json")
# (prompt tokens, budget): the default budget with a prompt it covers, and the 1,057-token document with
# a budget twice the default
CASES = ((900, 1024), (1057, 2048))


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def generate(model, ids: torch.Tensor, cache, new: int) -> list[int]:
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new, do_sample=False
    )
    return out[0, ids.shape[1] :].tolist()


def run_case(model, tok, dtype: str, prompt_tokens: int, budget: int, new: int) -> dict:
    from transformers import DynamicCache

    import hfkv
    from hfkv.evaluation.human_texts import human_documents
    from hfkv.storage import held_bytes

    doc = human_documents(tok, 1, prompt_tokens=prompt_tokens, continuation_tokens=0)[0]
    ids = torch.tensor([doc["ids"]])
    model.set_attn_implementation("sdpa")
    dense = DynamicCache(config=model.config)
    ref = generate(model, ids, dense, new)
    dense_bytes = sum(held_bytes([layer.keys, layer.values]) for layer in dense.layers)
    model.set_attn_implementation("eager")
    eager = generate(model, ids, DynamicCache(config=model.config), new)
    model.set_attn_implementation("sdpa")
    cache = hfkv.TriStateCache(model, "hfkv", budget=budget)  # switches the model to hfkv, delegating to sdpa
    got = generate(model, ids, cache, new)
    stats = cache.stats()
    totals = {k: sum(layer.totals()[k] for layer in stats.layers) for k in ("window", "original", "mid", "quantized")}
    return {
        "dtype": dtype,
        "source": doc["source"],
        "prompt_tokens": prompt_tokens,
        "new_tokens": new,
        "budget": budget,
        "identical": got == ref,
        "first_difference": first_difference(got, ref),
        "eager_vs_sdpa_first_difference": first_difference(eager, ref),
        "tokens": totals,
        "kv_bytes": stats.kv_bytes,
        "dynamic_cache_bytes": dense_bytes,
        "bytes_vs_dynamic_cache": stats.kv_bytes / dense_bytes,
        "budget_used": stats.kv_bytes / stats.budget_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated model dtypes (default: %(default)s)")
    ap.add_argument("--new", type=int, default=48, help="greedy tokens generated (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result file (default: %(default)s)")
    args = ap.parse_args(argv)
    from hfkv.atomic import write_atomic
    from hfkv.evaluation.results import provenance
    from hfkv.loading import load_model

    torch.set_num_threads(args.threads)
    rows = []
    for dtype in args.dtypes.split(","):
        model, tok = load_model("smollm2", dtype=dtype)
        for prompt_tokens, budget in CASES:
            row = run_case(model, tok, dtype, prompt_tokens, budget, args.new)
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_atomic(args.out, json.dumps({"provenance": provenance(threads=args.threads), "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
