"""How accuracy is measured on the testbed: one batch of a task's examples, generated greedily with a fresh cache
until the task's stop string (``"\\n"``) or EOS, each continuation's answer extracted and compared with the
target's (exact match, :meth:`hfkv.testbed.tasks.Task.score`), and the decode steps timed.

The one implementation behind :func:`evaluate` (DynamicCache and the presets: ``hfkv demo``, the notebooks'
``hfkv.inspect.testbed_sweep``, the training log of ``hfkv.testbed.train``) and
:func:`hfkv.evaluation.testbed_eval.evaluate_method` (any method spec, baselines included, for
``eval/sweep_testbed.py``), so every testbed accuracy the repository reports is measured the same way. The
callers choose the batches and count the bytes each cache holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import hfkv
from hfkv.testbed.tasks import TASKS, Task

__all__ = ["Batch", "StepClock", "evaluate", "run_batch", "stop_ids"]


class StepClock:
    """A logits processor that timestamps every generation step (the first call ends the prefill)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


class Batch(NamedTuple):
    """One generated and scored batch."""

    cache: Any  # the cache it generated with, holding the whole batch (for the caller's byte count)
    predictions: list[str]  # each row's continuation, special tokens skipped
    correct: int  # rows whose extracted answer equals the target's
    decode_tokens: int  # tokens produced by the decode steps (every step after the first) over all rows
    decode_s: float  # seconds from the end of the first step (the prefill) to the end of the last


def stop_ids(tok, task: Task) -> list[int]:
    """The token ids generation stops at: the task's stop string and EOS."""
    return [tok.convert_tokens_to_ids(task.stop), tok.eos_token_id]


def run_batch(
    model,
    tok,
    task: Task,
    rows: Sequence[dict],
    make_cache: Callable[[int], Any],
    max_new_tokens: int | None = None,
) -> Batch:
    """Generate the continuations of ``rows``' prompts (testbed rows ``{"prompt", "target"}``; one left-padded
    batch, greedy, at most ``max_new_tokens``, default the task's) with the cache ``make_cache(max_cache_len)``
    returns, ``max_cache_len`` being the longest the batch can grow (for caches that preallocate), and score them."""
    import torch  # torch and transformers load when a batch runs: `hfkv demo --help` imports this module
    from transformers import LogitsProcessorList  # deferred: keeps hfkv demo --help from importing transformers

    n_new = task.max_new_tokens if max_new_tokens is None else max_new_tokens
    enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True).to(model.device)
    prompt_len = enc["input_ids"].shape[1]
    cache = make_cache(prompt_len + n_new)
    clock = StepClock()
    with torch.no_grad():
        out = model.generate(
            **enc,
            past_key_values=cache,
            max_new_tokens=n_new,
            do_sample=False,
            eos_token_id=stop_ids(tok, task),
            pad_token_id=tok.pad_token_id,
            logits_processor=LogitsProcessorList([clock]),
        )
    preds = tok.batch_decode(out[:, prompt_len:], skip_special_tokens=True)
    correct = sum(bool(task.score(p, r["target"])) for p, r in zip(preds, rows, strict=True))
    steps = len(clock.times)
    if steps > 1:
        return Batch(cache, preds, correct, (steps - 1) * len(rows), clock.times[-1] - clock.times[0])
    return Batch(cache, preds, correct, 0, 0.0)


def evaluate(
    model,
    tok,
    task_name: str,
    data: list[dict],
    preset: str | None = None,
    budget: int | None = None,
    batch_size: int = 25,
    bar=None,
    warmup: bool = True,
) -> dict:
    """Greedy exact-match accuracy of ``model`` on ``data`` with a ``DynamicCache`` (``preset`` None)
    or a fresh ``TriStateCache(preset, budget)`` per batch (:func:`run_batch`); with the KV bytes held vs dense,
    and the decode speed.

    ``warmup`` runs one short untimed generation with the same kind of cache first, so the first
    row of a run does not pay one-off costs (lazy imports, thread pools, kernel builds) in its
    tok/s. ``bar`` (a tqdm) advances by one per example."""
    from transformers import DynamicCache  # as in run_batch

    # deferred: hfkv.storage imports torch; hfkv demo --help imports this module
    from hfkv.storage import dynamic_cache_bytes

    task = TASKS[task_name]
    correct = kv_bytes = dense_bytes = n_tok = 0
    t_dec = 0.0
    bs = max(1, batch_size)

    def new_cache(max_cache_len: int):  # neither cache preallocates
        if preset is None:
            return DynamicCache()
        return hfkv.TriStateCache(model, hfkv.TriStateConfig.from_preset(preset, budget=budget))

    if warmup and data:
        run_batch(model, tok, task, data[:2], new_cache, max_new_tokens=min(8, task.max_new_tokens))
    for i in range(0, len(data), bs):
        chunk = data[i : i + bs]
        batch = run_batch(model, tok, task, chunk, new_cache)
        cache = batch.cache
        n_tok += batch.decode_tokens
        t_dec += batch.decode_s
        correct += batch.correct
        if preset is None:
            kv_bytes += dynamic_cache_bytes(cache)
            dense_bytes += dynamic_cache_bytes(cache)
        else:
            st = cache.stats()
            kv_bytes += int(st.kv_bytes)
            dense_bytes += int(st.dense_bytes)
        if bar is not None:
            bar.update(len(chunk))
    return {
        "n": len(data),
        "accuracy": correct / max(1, len(data)),
        "compression": dense_bytes / kv_bytes if kv_bytes else float("nan"),
        "kv_kib": kv_bytes / 1024 / max(1, len(data)),
        "decode_tok_s": n_tok / t_dec if t_dec > 0 else float("nan"),
    }
