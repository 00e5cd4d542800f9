"""Accuracy and memory of one cache method on one testbed task (the unit of ``eval/sweep_testbed.py``).

The protocol of ``hfkv demo`` (:func:`hfkv.testbed.protocol.run_batch`: greedy, stop at ``"\\n"``, exact match of
the extracted answer, a fresh cache per batch; bytes read from the tensors held) but for any method spec —
baselines such as QuantizedCache included — so every row of the accuracy-vs-memory table is measured the same way.
Prompts are batched in order of length (longest first, as lm-eval does) so that left padding, which
a DynamicCache holds and hfkv evicts, stays small and per-example memory means what it says.
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm.auto import tqdm

from hfkv.evaluation.methods import Method, kv_and_dense_bytes
from hfkv.testbed.protocol import run_batch
from hfkv.testbed.tasks import TASKS


@torch.inference_mode()
def evaluate_method(
    model,
    tok,
    task_name: str,
    data: list[dict],
    method: Method,
    batch_size: int = 25,
    progress: str | None = None,
) -> dict[str, Any]:
    """Greedy exact-match accuracy of ``model`` with ``method``'s cache on ``data`` (testbed rows).

    Returns n, correct, accuracy, kv/dense bytes per example (whole batches divided by their size),
    memory_ratio (kv / dense), compression (dense / kv) and decode tokens/s (rows x decode steps / s).
    """
    if task_name not in TASKS:
        raise ValueError(f"task {task_name!r} is not a testbed task; known: {sorted(TASKS)}")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    task = TASKS[task_name]
    order = sorted(range(len(data)), key=lambda i: (-len(tok(data[i]["prompt"])["input_ids"]), i))
    correct = kv_total = dense_total = decode_tokens = 0
    decode_s = 0.0
    bar = tqdm(total=len(data), desc=progress, leave=False, disable=progress is None)
    for s in range(0, len(order), batch_size):
        rows = [data[i] for i in order[s : s + batch_size]]
        batch = run_batch(model, tok, task, rows, lambda n: method.make_cache(model, max_cache_len=n))
        correct += batch.correct
        kv, dense = kv_and_dense_bytes(model, batch.cache, batch=len(rows))
        kv_total += kv
        dense_total += dense
        decode_tokens += batch.decode_tokens
        decode_s += batch.decode_s
        bar.update(len(rows))
    bar.close()
    n = len(data)
    return {
        "n": n,
        "correct": correct,
        "accuracy": correct / n if n else float("nan"),
        "kv_bytes": kv_total / n if n else float("nan"),
        "dense_bytes": dense_total / n if n else float("nan"),
        "memory_ratio": kv_total / dense_total if dense_total else float("nan"),
        "compression": dense_total / kv_total if kv_total else float("nan"),
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else float("nan"),
    }
