"""What compressing a context costs with each score source of hfkv.compress, against a plain prefill -> JSON.

For each ``--lengths`` a context of that many tokens of human-written text (the Python reference's prose, the
haystack of the ``*_pydoc`` RULER tasks: hfkv.evaluation.ruler_pydoc) is run, in interleaved rounds:

- ``prefill``: the model over the context into a DynamicCache (what any cache's prompt costs);
- ``compress:<source>``: ``hfkv.compress(model, context, "hfkv", scores=<source>)`` for each of
  hfkv.compress_once.SCORE_SOURCES (``reconstruction`` adds the KVzip-style repetition pass).

Each entry's wall times (ms) with median and mean, and its median over prefill's. Timing only on a quiet machine
(hfkv.evaluation.quiet; docs/bench.md "Timing honestly"); a busy run is marked busy.

    python eval/compress_once_cost.py                 # hfkv-out/eval/compress_once_cost_smollm2.json
    python eval/compress_once_cost.py --out eval/results/compress_once_cost_smollm2.json   # the committed file
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def out_path(args: argparse.Namespace) -> Path:
    """``--out``, or the default file of ``--model`` under the working directory."""
    return args.out or Path(f"hfkv-out/eval/compress_once_cost_{os.path.basename(args.model)}.json")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import DynamicCache

    import hfkv
    from hfkv.atomic import write_atomic
    from hfkv.compress_once import SCORE_SOURCES
    from hfkv.evaluation import quiet
    from hfkv.evaluation.results import parse_list, provenance
    from hfkv.evaluation.ruler_pydoc import haystack_text
    from hfkv.loading import load_model, parse_dtype

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="hfkv.loading model spec (default %(default)s)")
    ap.add_argument("--dtype", default="fp32", help="the dtype the context runs in (default %(default)s)")
    ap.add_argument("--lengths", default="4096", help="context lengths in tokens, comma-separated")
    ap.add_argument("--budget", type=int, default=256, help="the hfkv preset's budget (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every entry (default 3)")
    quiet.add_arguments(ap, default_threads="all")
    ap.add_argument("--out", type=Path, default=None, help="default hfkv-out/eval/compress_once_cost_<model>.json")
    args = ap.parse_args(argv)
    out = out_path(args)
    (threads,) = args.threads if len(args.threads) == 1 else (None,)
    if threads is None:
        raise SystemExit(f"--threads: one thread count, got {args.threads}")
    model, tok = load_model(args.model, dtype=parse_dtype(args.dtype))
    text, digest = haystack_text()
    ids_all = tok(text, return_tensors="pt").input_ids
    try:
        record = quiet.start(args.threads, args.max_load, args.wait_quiet, args.force_busy)
    except quiet.BusyMachine as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(threads)
    result = {"model": args.model, "dtype": args.dtype, "budget": args.budget, "threads": threads,
              "haystack_sha256": digest, "quiet": record, "runs": []}  # fmt: skip

    def prefill(ids):
        model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)

    def compressing(source):
        return lambda ids: hfkv.compress(model, ids, "hfkv", scores=source, tokenizer=tok, budget=args.budget)

    entries = {"prefill": prefill, **{f"compress:{s}": compressing(s) for s in SCORE_SOURCES}}
    with torch.no_grad():
        for length in [int(x) for x in parse_list(args.lengths)]:
            if ids_all.shape[1] < length:
                raise SystemExit(f"--lengths: {length} is more than the haystack's {ids_all.shape[1]} tokens")
            ids = ids_all[:, :length]
            ms: dict[str, list[float]] = {name: [] for name in entries}
            for _ in range(args.rounds):
                for name, fn in entries.items():
                    t0 = time.perf_counter()
                    fn(ids)
                    ms[name].append(round((time.perf_counter() - t0) * 1e3, 1))
            base = statistics.median(ms["prefill"])
            run = {"length": length, "rounds": args.rounds, "ms": ms,
                   "ms_median": {k: statistics.median(v) for k, v in ms.items()},
                   "ms_mean": {k: statistics.mean(v) for k, v in ms.items()},
                   "x_prefill": {k: statistics.median(v) / base for k, v in ms.items()}}  # fmt: skip
            result["runs"].append(run)
            print(json.dumps({"length": length, "x_prefill": run["x_prefill"]}), flush=True)
            write_atomic(out, json.dumps(result, indent=2))
    quiet.finish(record)
    result |= {k: v for k, v in provenance().items() if k not in result}
    result["busy"] = record["busy"]
    write_atomic(out, json.dumps(result, indent=2))
    print(f"wrote {out} ({quiet.describe(record)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
