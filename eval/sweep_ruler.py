"""RULER (lm-eval's offline tasks) for every cache at matched memory -> hfkv-out/eval/ruler_<model>.jsonl.

One row per (model, dtype, task, length, example, method): RULER's score of the example (lm-eval's
``process_results``), the generated text, the bytes the cache held at the end against what a DynamicCache
holds for the same tokens, and provenance. Examples are the first ``--limit`` of each task as lm-eval builds
them (the data is generated offline with the model's tokenizer). Every method of one example reuses one
prompt forward (hfkv.evaluation.ruler.SharedPrefillLM, token-identical to ``generate``), so a method costs
its decode steps only; a generation ends once every reference string is in the output (the score cannot
change after that), or at EOS / ``max_gen_toks`` as in lm-eval.

Rows already in the file are skipped (``--force`` re-runs them; a row whose method config changed is re-run),
so the sweep resumes where it stopped, and ``--limit`` can grow where two methods are close. The prompt runs in
``--prefill-dtype`` (fp32: ~4x faster than bf16 on a CPU without bf16 matrix units) and the cache holds
``--dtype`` tensors (bf16: what a GPU user holds, so memory ratios mean what they mean there). A run appends to
``hfkv-out/eval/ruler_<model>.jsonl`` under the working directory unless ``--out`` names another file; the
committed results are extended only when named. Their rows were made with

    python eval/sweep_ruler.py --tasks niah_single_1 --lengths 4096 --limit 12 --out eval/results/ruler_smollm2.jsonl
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

DEFAULT_METHODS = (
    "dynamic,quanto-int4,quanto-int2,quant@none,evict@256,evict@512,streaming@512,"
    "arkv@1024,diffkv@none,hfkv@128,hfkv@256,hfkv@512,hfkv@1024"
)
KEY = ("model", "dtype", "task", "length", "doc_id", "method")
MATCH = ("config", "options")
OUT_DIR = "hfkv-out/eval"  # a run's default folder, under the working directory; eval/results/ only by --out
TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")  # the *_pydoc task files


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=[DEFAULT_METHODS], help="method specs (default: %(default)s)")
    ap.add_argument("--tasks", default="niah_single_1",
                    help="RULER offline tasks, or their essay-haystack ones on the Python reference (*_pydoc: "
                    "eval/tasks/ruler_pydoc), comma-separated")  # fmt: skip
    ap.add_argument("--lengths", default="4096", help="max_seq_lengths, comma-separated (default 4096)")
    ap.add_argument("--limit", type=int, default=12, help="examples per task and length (default 12)")
    ap.add_argument("--start", type=int, default=0, help="first example index (default 0)")
    ap.add_argument("--model", default="smollm2", help="hfkv.loading model spec (default smollm2)")
    ap.add_argument("--dtype", default="bf16", help="dtype of the decoding model and its caches (default bf16)")
    ap.add_argument("--prefill-dtype", default="fp32", help="dtype the prompt forward runs in (default fp32)")
    ap.add_argument("--out", default=None, help=f"result file (default {OUT_DIR}/ruler_<model>.jsonl)")
    ap.add_argument("--force", action="store_true", help="re-run rows already in --out")
    ap.add_argument("--full-length", action="store_true", help="never stop a generation before EOS/max_gen_toks")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's default)")
    ap.add_argument("--question-agnostic", action="store_true",
                    help="compress each context before its question is read (hfkv.compress); rows go to "
                    f"{OUT_DIR}/compress_once_ruler_<model>.jsonl unless --out names another file")  # fmt: skip
    ap.add_argument("--context-scores", default="reconstruction,key_norm,observation",
                    help="with --question-agnostic: the score sources each hfkv method runs with, comma-separated "
                    "(default %(default)s); other caches hold the context as a prefill leaves it")  # fmt: skip
    return ap


def _scored(method) -> bool:
    """Whether a method's context is scored by ``--context-scores`` (hfkv configs ranking by attention)."""
    return method.config is not None and method.config.score_source == "attention"


def _own_scores(method) -> str:
    """What ranks a context a method does not score by ``--context-scores``: its gates, or nothing of its own."""
    return "retention" if method.config is not None else "observation"


def out_path(args: argparse.Namespace) -> str:
    """``--out``, or the default file of ``--model`` under the working directory."""
    kind = "compress_once_ruler" if args.question_agnostic else "ruler"
    return args.out or f"{OUT_DIR}/{kind}_{os.path.basename(args.model)}.jsonl"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from hfkv.compress_once import SCORE_SOURCES
    from hfkv.evaluation.methods import expand_methods, stored_row_as_today
    from hfkv.evaluation.results import ResultFile, git_commit, parse_list, provenance
    from hfkv.evaluation.ruler import OFFLINE_TASKS, PYDOC_TASKS, SharedPrefillLM, load_examples, tokenizer_path
    from hfkv.loading import TESTBED, load_model, parse_dtype

    git_commit()
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = parse_list(args.tasks)
    for t in tasks:
        if t not in OFFLINE_TASKS + PYDOC_TASKS:
            raise SystemExit(f"--tasks: {t!r} is not one of RULER's offline tasks {OFFLINE_TASKS + PYDOC_TASKS}")
    lengths = [int(x) for x in parse_list(args.lengths)]
    if args.limit < 1:
        raise SystemExit(f"--limit={args.limit} must be >= 1")
    dtype, pre_dtype = parse_dtype(args.dtype), parse_dtype(args.prefill_dtype)
    methods, skipped = expand_methods(args.methods)
    for spec, why in skipped:
        print(f"skipping {spec}: {why}", file=sys.stderr)
    sources = parse_list(args.context_scores) if args.question_agnostic else [None]
    for src in sources:
        if src is not None and src not in SCORE_SOURCES:
            raise SystemExit(f"--context-scores: {src!r} is not one of {SCORE_SOURCES}")
    key = KEY + ("context_scores",) if args.question_agnostic else KEY
    out = ResultFile(out_path(args), key, MATCH, normalize=stored_row_as_today)
    tok_path = tokenizer_path(args.model)
    pre_model, tok = load_model(args.model, dtype=pre_dtype)
    model = pre_model if dtype == pre_dtype else copy.deepcopy(pre_model).to(dtype)
    extra = {"add_bos_token": True} if args.model == TESTBED else {}  # as `hfkv eval` sets it for the testbed
    lm = SharedPrefillLM(model, tok, prefill_model=pre_model, stop_when_found=not args.full_length,
                         question_agnostic=args.question_agnostic, **extra)  # fmt: skip
    base = {"model": args.model, "dtype": args.dtype}
    t_all = time.perf_counter()
    for task in tasks:
        for length in lengths:
            examples = load_examples(task, length, tok_path, args.start + args.limit, TASKS_DIR)[args.start :]
            for ex in examples:
                # question-agnostic: every hfkv method with each score source, other caches once
                runs = [(m, s) for m in methods for s in (sources if _scored(m) else sources[:1])]
                for m, src in runs:
                    row_key = {**base, "task": task, "length": length, "doc_id": ex.doc_id, **m.describe()}
                    if args.question_agnostic:
                        row_key["context_scores"] = src if _scored(m) else _own_scores(m)
                        lm.context_scores = row_key["context_scores"]
                    if not args.force and out.has(row_key):
                        continue
                    t0 = time.perf_counter()
                    r = lm.generate_one(ex, m)
                    row = {
                        **row_key,
                        **r,
                        "memory_ratio": r["kv_bytes"] / r["dense_bytes"],
                        "refs": ex.refs,
                        "prefill_dtype": args.prefill_dtype,
                        "stop_when_found": not args.full_length,
                        "wall_s": round(time.perf_counter() - t0, 2),
                        **provenance(),
                    }
                    out.append(row)
                    print(
                        f"{task} {length} #{ex.doc_id} {m.label:<28} {row_key.get('context_scores', ''):<14} "
                        f"score={r['score']:.2f} "
                        f"mem={row['memory_ratio']:.3f} {row['wall_s']:.1f}s {r['output'][:40]!r}",
                        flush=True,
                    )
    print(f"done in {time.perf_counter() - t_all:.0f}s -> {out.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
