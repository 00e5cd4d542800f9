"""``hfkv demo``: accuracy vs KV memory of the presets on the shipped testbed.

Loads the testbed model (``hfkv.testbed.TESTBED_PATH``), runs each task's shipped test set
(``--limit`` examples per task) with greedy generation, first with a plain ``DynamicCache``, then
with each preset of ``--presets`` at each budget of ``--budgets`` (a fresh ``TriStateCache`` per
``generate`` call), and prints one row per (task, cache): exact-match accuracy, compression ratio
(KV bytes a DynamicCache would hold for the same tokens / KV bytes held) and decode tokens/s.
``--presets none`` runs only the DynamicCache rows.
"""

from __future__ import annotations

import argparse
import os
import time

DEFAULT_PRESETS = "evict,quant,streaming,arkv,diffkv,hfkv"
DEFAULT_BUDGETS = "80,160"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the shipped testbed)")
    parser.add_argument("--tasks", default=None, help="comma-separated task names (default: all testbed tasks)")
    parser.add_argument("--limit", type=int, default=100, help="examples per task (default: 100, the whole test set)")
    parser.add_argument(
        "--presets", default=DEFAULT_PRESETS, help=f"comma-separated presets, or 'none' (default: {DEFAULT_PRESETS})"
    )
    parser.add_argument(
        "--budgets", default=DEFAULT_BUDGETS, help=f"comma-separated token budgets (default: {DEFAULT_BUDGETS})"
    )
    parser.add_argument(
        "--batch-size", type=int, default=25, help="prompts per generate call (left padding; default 25)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


class _StepClock:
    """A logits processor that timestamps every generation step (first call = end of prefill)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def _generate(model, tok, prompts, cache, max_new_tokens, stop_ids):
    import torch
    from transformers import LogitsProcessorList

    enc = tok(prompts, return_tensors="pt", padding=True).to(model.device)
    clock = _StepClock()
    with torch.no_grad():
        out = model.generate(
            **enc,
            past_key_values=cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop_ids,
            pad_token_id=tok.pad_token_id,
            logits_processor=LogitsProcessorList([clock]),
        )
    new = out[:, enc["input_ids"].shape[1] :]
    preds = tok.batch_decode(new, skip_special_tokens=True)
    # Decode throughput: tokens produced by the decode steps (every step after the first) per second.
    steps = len(clock.times)
    dt = clock.times[-1] - clock.times[0] if steps > 1 else 0.0
    return preds, (steps - 1) * len(prompts), dt


def evaluate(
    model,
    tok,
    task_name: str,
    data: list[dict],
    preset: str | None = None,
    budget: int | None = None,
    batch_size: int = 25,
    progress: str | None = None,
) -> dict:
    """Greedy exact-match accuracy of ``model`` on ``data`` with a ``DynamicCache`` (``preset`` None)
    or a fresh ``TriStateCache(preset, budget)`` per batch; with the KV bytes held vs dense, and
    the decode speed."""
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from hfkv.storage import dynamic_cache_bytes
    from hfkv.testbed.tasks import TASKS

    task = TASKS[task_name]
    stop_ids = [tok.convert_tokens_to_ids("\n"), tok.eos_token_id]
    correct = kv_bytes = dense_bytes = n_tok = 0
    t_dec = 0.0
    bs = max(1, batch_size)
    bar = tqdm(total=len(data), desc=progress, leave=False, disable=progress is None)
    for i in range(0, len(data), bs):
        chunk = data[i : i + bs]
        if preset is None:
            cache = DynamicCache()
        else:
            import hfkv

            cache = hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset(preset, budget=budget))
        preds, nt, dt = _generate(model, tok, [r["prompt"] for r in chunk], cache, task.max_new_tokens, stop_ids)
        n_tok += nt
        t_dec += dt
        correct += sum(task.score(p, r["target"]) for p, r in zip(preds, chunk, strict=True))
        if preset is None:
            kv_bytes += dynamic_cache_bytes(cache)
            dense_bytes += dynamic_cache_bytes(cache)
        else:
            st = cache.stats()
            kv_bytes += int(st.kv_bytes)
            dense_bytes += int(st.dense_bytes)
        bar.update(len(chunk))
    bar.close()
    return {
        "n": len(data),
        "accuracy": correct / max(1, len(data)),
        "compression": dense_bytes / kv_bytes if kv_bytes else float("nan"),
        "kv_kib": kv_bytes / 1024 / max(1, len(data)),
        "decode_tok_s": n_tok / t_dec if t_dec > 0 else float("nan"),
    }


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfkv.testbed import TESTBED_PATH
    from hfkv.testbed.tasks import TASKS, load_test_set

    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or TESTBED_PATH
    if not os.path.exists(os.path.join(path, "config.json")):
        raise SystemExit(
            f"--model: no model at {path!r} (expected config.json, safetensors and tokenizer files); "
            "the testbed ships in hfkv/testbed/model, or train one with `python -m hfkv.testbed.train`"
        )
    model = AutoModelForCausalLM.from_pretrained(path).to(args.device)
    model.eval()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"

    task_names = [t.strip() for t in (args.tasks or ",".join(TASKS)).split(",") if t.strip()]
    for t in task_names:
        if t not in TASKS:
            raise SystemExit(f"unknown task {t!r}; known: {', '.join(TASKS)}")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if presets == ["none"] or not presets:
        presets = []
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]

    configs: list[tuple[str, str | None, int | None]] = [("DynamicCache", None, None)]
    configs += [(f"{name}@{b}", name, b) for name in presets for b in budgets]

    rows = []
    for task_name in task_names:
        data = load_test_set(task_name)[: args.limit]
        for label, preset, budget in configs:
            r = evaluate(
                model,
                tok,
                task_name,
                data,
                preset,
                budget,
                batch_size=args.batch_size,
                progress=f"{task_name} {label}" if not args.no_progress else None,
            )
            rows.append({"task": task_name, "cache": label, **r})

    header = (
        f"{'task':<10} {'cache':<16} {'n':>4} {'accuracy':>9} {'compression':>12} {'KV KiB/ex':>10} "
        f"{'decode tok/s':>13}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        speed = r["decode_tok_s"]
        speed = f"{speed:>13.1f}" if speed == speed else f"{'-':>13}"  # NaN: no decode step happened
        print(
            f"{r['task']:<10} {r['cache']:<16} {r['n']:>4} {r['accuracy']:>9.3f} {r['compression']:>11.2f}x "
            f"{r['kv_kib']:>10.1f} {speed}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
