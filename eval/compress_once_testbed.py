"""Compress once, ask many, on the testbed's key-value recall: the context compressed before any question, then
several questions answered from it -> a JSONL file (``--out``).

Each of the shipped 100 ``kv_recall`` test prompts is its records and filler, three answered examples, and a last
question ``? <key>``; the context here is the prompt without that last question, and the questions are that key and
``--questions - 1`` more keys of the records (the first ones not asked in the examples), each answered from a
``fork()`` of one compressed context (greedy, its value's 4 digits checked). One row per (method, context_scores):
questions asked, correct answers with a Wilson interval, and the bytes held after compression against a
DynamicCache's for the context. hfkv methods run with each ``--context-scores`` source (hfkv.compress); other caches
hold the context as a prefill leaves it. ``question_aware`` rows put each question in the prompt instead (the
context is compressed with the question in view, once per question): what withholding the question costs.
``--per-question`` rows (``"compressed": "per_question"``) compress the context afresh for every question instead of
forking one compressed context: what answering many questions from one compression costs (nothing, if ``fork``
copies exactly what a fresh compression holds).

Rows already in the file are skipped unless --force. The committed rows were made with

    python eval/compress_once_testbed.py --out eval/results/compress_once_testbed.jsonl
    python eval/compress_once_testbed.py --per-question --methods hfkv@48,hfkv@64 --context-scores reconstruction \
        --out eval/results/compress_once_testbed.jsonl
"""

from __future__ import annotations

import argparse
import os
import re
import time

DEFAULT_METHODS = "dynamic,hfkv@48,hfkv@64,hfkv@96,evict@64,evict@96,streaming@96,quanto-int4"
KEY = ("method", "context_scores", "questions", "compressed")  # compressed: absent (once) or "per_question"
MATCH = ("config", "options")
OUT_DIR = "hfkv-out/eval"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=DEFAULT_METHODS, help="method specs, comma-separated (default %(default)s)")
    ap.add_argument("--context-scores", default="reconstruction,key_norm,observation,question_aware",
                    help="score sources of the hfkv methods, comma-separated (default %(default)s)")  # fmt: skip
    ap.add_argument("--questions", type=int, default=3, help="questions per context (default 3)")
    ap.add_argument("--limit", type=int, default=100, help="test prompts (default 100, the whole set)")
    ap.add_argument("--out", default=f"{OUT_DIR}/compress_once_testbed.jsonl", help="result file")
    ap.add_argument("--per-question", action="store_true",
                    help="compress the context afresh for each question instead of forking one compression "
                    "(hfkv methods, question-agnostic sources)")  # fmt: skip
    ap.add_argument("--force", action="store_true", help="re-run rows already in --out")
    ap.add_argument("--threads", type=int, default=1)
    return ap


def _questions(prompt: str, n: int) -> tuple[str, list[tuple[str, str]]]:
    """``(context, [(key, value)])``: the prompt without its last question, that question's key first."""
    context, last = prompt.rsplit("\n? ", 1)
    records = dict(re.findall(r"^- (\w+) (\d+)$", context, flags=re.M))
    shown = set(re.findall(r"^\? (\w+) \d+$", context, flags=re.M))
    keys = [last.strip()] + [k for k in records if k not in shown and k != last.strip()]
    return context, [(k, records[k]) for k in keys[:n]]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import hfkv
    from hfkv.evaluation.methods import expand_methods, kv_and_dense_bytes, stored_row_as_today
    from hfkv.evaluation.results import ResultFile, parse_list, provenance, wilson_interval
    from hfkv.testbed import load_test_set, load_testbed

    torch.set_num_threads(args.threads)
    model, tok = load_testbed()
    data = load_test_set("kv_recall")[: args.limit]
    methods, _ = expand_methods([args.methods])
    sources = parse_list(args.context_scores)
    out = ResultFile(args.out, KEY, MATCH, normalize=stored_row_as_today)
    if args.per_question:
        methods = [m for m in methods if m.config is not None]
        sources = [s for s in sources if s != "question_aware"]
        if not methods or not sources:
            raise SystemExit("--per-question compares hfkv methods under question-agnostic --context-scores")
    for m in methods:
        for src in sources if m.config is not None else ["observation"]:
            row_key = {**m.describe(), "context_scores": src, "questions": args.questions}
            if args.per_question:
                row_key["compressed"] = "per_question"
            if not args.force and out.has(row_key):
                continue
            t0, asked, correct, ratios = time.perf_counter(), 0, 0, []
            for ex in data:
                context, qa = _questions(ex["prompt"], args.questions)
                ctx = tok(context, return_tensors="pt").input_ids
                if src != "question_aware":
                    if m.config is not None:
                        cache = hfkv.compress(model, ctx, m.config, scores=src, tokenizer=tok)
                    else:
                        cache = m.make_cache(model)
                        with torch.no_grad():
                            model(input_ids=ctx, past_key_values=cache)
                    kv, dense = kv_and_dense_bytes(model, cache, batch=1)
                    ratios.append(kv / dense)
                for key, value in qa:
                    q = tok(f"\n? {key}", return_tensors="pt", add_special_tokens=False).input_ids
                    ids = torch.cat([ctx, q], 1)
                    if src == "question_aware":  # the question in the prompt: compressed with it in view
                        run = m.make_cache(model)
                    elif args.per_question:
                        run = hfkv.compress(model, ctx, m.config, scores=src, tokenizer=tok)
                    elif hasattr(cache, "fork"):
                        run = cache.fork()
                    else:  # transformers' caches have no fork (a QuantizedCache cannot be deep-copied): again
                        run = m.make_cache(model)
                        with torch.no_grad():
                            model(input_ids=ctx, past_key_values=run)
                    gen = model.generate(ids, past_key_values=run, max_new_tokens=3, do_sample=False)
                    if src == "question_aware":  # held at the end, over the prompt and 2 of 3 new tokens
                        kv, dense = kv_and_dense_bytes(model, run, batch=1)
                        ratios.append(kv / dense)
                    text = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
                    asked += 1
                    correct += text.strip().startswith(value)
            lo, hi = wilson_interval(correct, asked)
            row = {**row_key, "asked": asked, "correct": correct, "accuracy": correct / asked, "ci95": [lo, hi],
                   "memory_ratio": sum(ratios) / len(ratios), "contexts": len(data),
                   "wall_s": round(time.perf_counter() - t0, 1), **provenance()}  # fmt: skip
            out.append(row)
            print(f"{m.label:<16} {src:<15} {correct}/{asked} = {correct / asked:.3f} [{lo:.2f}, {hi:.2f}] "
                  f"mem={row['memory_ratio']:.3f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
