"""Synthetic tasks of the testbed: tasks where losing the wrong cached tokens costs accuracy.

Every task is deterministic by seed (a private ``random.Random``, never global state) and returns
examples ``{"prompt": str, "target": str}``. The model's continuation of ``prompt`` is expected to
be ``target`` followed by the stop string ``"\\n"``. One character is one token (see
``hfkv.testbed.tokenizer``), so lengths in characters are lengths in tokens (plus one ``<s>``).

``kv_recall`` -- long-context key-value recall::

    kqzt: 48213
    the river holds a quiet lamp near the old road
    mbwa: 9041
    ...
    ? hrxo: 771203         <- answered questions (records from anywhere in the context)
    ? kqzt:                <- final question: the prompt ends with "? kqzt: "

    target: "48213"

  The keys are unique random 4-letter strings, the values 4-6 digit numbers; the record asked by the
  final question lies in the first third of the context (``early_frac``) and is asked nowhere else,
  so a cache that evicted (or badly quantized) that record cannot answer.
  Extraction: the first run of digits of the prediction's first line.

``arith_cot`` -- multi-step arithmetic with a generated chain of thought::

    q=7
    the green kettle sings        <- filler lines (optional)
    k=12
    a=k+5
    b=a-q
    c=b+31
    ? c

    target: "a=k+5 = 12+5 = 17; b=a-q = 17-7 = 10; c=b+31 = 10+31 = 41 #### 41"

  Each step restates its definition, substitutes the values (the previous step's result, written
  earlier in the chain of thought, and named constants defined in the prompt) and computes; every
  intermediate value stays in 0..99. The prediction must end with ``#### <answer>`` as in GSM8K.
  Extraction: the number after the first ``####`` of the prediction.

Test sets: ``python -m hfkv.testbed.tasks --write eval/tasks`` writes ``testbed_<task>.jsonl``
(``TEST_SEEDS`` / ``TEST_SIZE`` / each task's ``test_kwargs``) and a manifest.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field

STOP = "\n"

FILLER_WORDS = (
    "the a an of in on at to from with near under over and or but old new small large quiet loud "
    "green blue red dark bright cold warm river stone lamp road house tree field cloud wind rain "
    "bird fish door window garden bridge tower ship market song story kettle letter paper candle "
    "walks holds keeps finds carries watches sings opens turns waits rests grows falls moves"
).split()


def _filler_line(rng: random.Random) -> str:
    return " ".join(rng.choice(FILLER_WORDS) for _ in range(rng.randint(3, 9)))


def _pick_len(rng: random.Random, length: int | tuple[int, int] | list[int]) -> int:
    if isinstance(length, (tuple, list)):
        return rng.randint(int(length[0]), int(length[1]))
    return int(length)


# --------------------------------------------------------------------------------------------
# kv_recall
# --------------------------------------------------------------------------------------------


def kv_recall_example(
    rng: random.Random,
    length: int | tuple[int, int] = (800, 1400),
    n_questions: int = 4,
    chars_per_record: int = 42,
    early_frac: float = 1 / 3,
    question_frac: float | None = None,
    key_len: int = 4,
    key_chars: str = string.ascii_lowercase,
) -> dict:
    """One kv_recall example of about ``length`` prompt characters.

    ``question_frac`` (training only) asks about that fraction of the records instead of
    ``n_questions``. Returns ``prompt``, ``target`` and ``supervise``: the (start, end) character spans of the
    prompt that hold answers (the values of the answered questions), used for training.
    """
    total = _pick_len(rng, length)
    if question_frac is None:
        n_rec = max(n_questions + 2, round(total / chars_per_record))
    else:  # training: ask about a fraction of the records (denser supervision)
        n_rec = max(3, round(total / chars_per_record))
        n_questions = min(n_rec - 1, max(1, round(question_frac * n_rec)))
    keys: list[str] = []
    seen: set[str] = set()
    while len(keys) < n_rec:
        k = "".join(rng.choice(key_chars) for _ in range(key_len))
        if k not in seen:
            seen.add(k)
            keys.append(k)
    values = [str(rng.randint(10 ** (d - 1), 10**d - 1)) for d in (rng.randint(4, 6) for _ in keys)]
    records = [f"{k}: {v}" for k, v in zip(keys, values, strict=True)]
    q_chars = n_questions * 14
    body_target = max(0, total - q_chars)
    rec_chars = sum(len(r) + 1 for r in records)
    fillers: list[str] = []
    fill_chars = 0
    while rec_chars + fill_chars < body_target:
        line = _filler_line(rng)
        fillers.append(line)
        fill_chars += len(line) + 1
    items = [(True, i) for i in range(n_rec)] + [(False, j) for j in range(len(fillers))]
    rng.shuffle(items)
    lines: list[str] = []
    offsets: dict[int, int] = {}
    pos = 0
    for is_rec, idx in items:
        line = records[idx] if is_rec else fillers[idx]
        if is_rec:
            offsets[idx] = pos
        lines.append(line)
        pos += len(line) + 1
    body_len = pos
    early = [i for i in range(n_rec) if offsets[i] < early_frac * body_len]
    if not early:
        early = [min(range(n_rec), key=lambda i: offsets[i])]
    final = rng.choice(early)
    others = rng.sample([i for i in range(n_rec) if i != final], n_questions - 1)
    prompt = "".join(line + "\n" for line in lines)
    supervise = []
    for i in others:
        prompt += f"? {keys[i]}: "
        supervise.append((len(prompt), len(prompt) + len(values[i]) + 1))  # value and "\n"
        prompt += values[i] + "\n"
    prompt += f"? {keys[final]}: "
    return {"prompt": prompt, "target": values[final], "supervise": supervise}


_DIGITS = re.compile(r"\d+")


def kv_recall_extract(text: str) -> str | None:
    """The first run of digits on the first line of ``text`` (None if there is none)."""
    m = _DIGITS.search(text.split("\n", 1)[0])
    return m.group(0) if m else None


# --------------------------------------------------------------------------------------------
# arith_cot
# --------------------------------------------------------------------------------------------

CONST_NAMES = "klmnopqrstuvwxyz"
CHAIN_NAMES = "abcdefghij"


def arith_cot_example(
    rng: random.Random,
    steps: int | tuple[int, int] = (4, 8),
    consts: int | tuple[int, int] = (3, 5),
    filler: int | tuple[int, int] = (4, 8),
    const_prob: float = 0.5,
) -> dict:
    """One arith_cot example: named constants, a chain of ``steps`` operations, filler lines."""
    n_steps = min(_pick_len(rng, steps), len(CHAIN_NAMES))
    n_consts = min(_pick_len(rng, consts), len(CONST_NAMES))
    n_fill = _pick_len(rng, filler)
    names = rng.sample(CONST_NAMES, n_consts)
    cval = {c: rng.randint(2, 49) for c in names}
    defs_c = [f"{c}={cval[c]}" for c in names]
    defs_s: list[str] = []
    cot: list[str] = []
    prev_name, prev_val = None, None
    for i in range(n_steps):
        v = CHAIN_NAMES[i]
        if i == 0:
            a_name = rng.choice(names)
            a_val = cval[a_name]
        else:
            a_name, a_val = prev_name, prev_val
        if rng.random() < const_prob:
            b_name = rng.choice(names)
            b_val = cval[b_name]
        else:
            b_val = rng.randint(1, 9)
            b_name = str(b_val)
        ops = [o for o, r in (("+", a_val + b_val), ("-", a_val - b_val)) if 0 <= r <= 99]
        op = rng.choice(ops)
        res = a_val + b_val if op == "+" else a_val - b_val
        defs_s.append(f"{v}={a_name}{op}{b_name}")
        cot.append(f"{v}={a_name}{op}{b_name} = {a_val}{op}{b_val} = {res}")
        prev_name, prev_val = v, res
    # Filler lines go anywhere; definitions keep their order (constants first, then the chain).
    defs = defs_c + defs_s
    slots = sorted(rng.randint(0, len(defs)) for _ in range(n_fill))
    lines: list[str] = []
    k = 0
    for j, d in enumerate(defs):
        while k < len(slots) and slots[k] == j:
            lines.append(_filler_line(rng))
            k += 1
        lines.append(d)
    while k < len(slots):
        lines.append(_filler_line(rng))
        k += 1
    prompt = "".join(line + "\n" for line in lines) + f"? {prev_name}\n"
    target = "; ".join(cot) + f" #### {prev_val}"
    return {"prompt": prompt, "target": target, "supervise": []}


_HASH = re.compile(r"####\s*(-?\d+)")


def arith_cot_extract(text: str) -> str | None:
    """The number after the first ``####`` of ``text`` (None if there is none)."""
    m = _HASH.search(text)
    return m.group(1) if m else None


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    name: str
    example: Callable[..., dict]  # (rng, **knobs) -> {"prompt", "target", "supervise"}
    extract: Callable[[str], str | None]
    max_new_tokens: int
    test_kwargs: dict = field(default_factory=dict)
    stop: str = STOP

    def generate(self, n: int, seed: int, **knobs) -> list[dict]:
        """``n`` examples ``{"prompt", "target"}``, deterministic in (``n``, ``seed``, ``knobs``)."""
        rng = random.Random(f"{self.name}:{seed}")
        out = []
        for _ in range(n):
            ex = self.example(rng, **knobs)
            out.append({"prompt": ex["prompt"], "target": ex["target"]})
        return out

    def score(self, prediction: str, target: str) -> bool:
        """Exact match of the extracted answers of ``prediction`` and ``target``."""
        got = self.extract(prediction)
        return got is not None and got == self.extract(target)


TASKS: dict[str, Task] = {
    "kv_recall": Task(
        "kv_recall",
        kv_recall_example,
        kv_recall_extract,
        max_new_tokens=8,
        test_kwargs={"length": (800, 1400), "n_questions": 4},
    ),
    "arith_cot": Task(
        "arith_cot",
        arith_cot_example,
        arith_cot_extract,
        max_new_tokens=200,
        test_kwargs={"steps": (4, 8), "consts": (3, 5), "filler": (4, 8)},
    ),
}

TEST_SEEDS = {"kv_recall": 1001, "arith_cot": 1002}
TEST_SIZE = 100


def test_set(name: str, n: int = TEST_SIZE) -> list[dict]:
    """The shipped test set of task ``name`` as the generator produces it."""
    task = TASKS[name]
    rows = task.generate(n, TEST_SEEDS[name], **task.test_kwargs)
    for r in rows:
        r["answer"] = task.extract(r["target"])
    return rows


def test_set_path(name: str, root: str | os.PathLike | None = None) -> str:
    if root is None:
        root = os.path.join(os.path.dirname(__file__), "..", "..", "eval", "tasks")
    return os.path.normpath(os.path.join(str(root), f"testbed_{name}.jsonl"))


def load_test_set(name: str, root: str | os.PathLike | None = None) -> list[dict]:
    """Read a shipped JSONL test set (falls back to regenerating it if the file is absent)."""
    path = test_set_path(name, root)
    if not os.path.exists(path):
        return test_set(name)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_test_sets(out_dir: str | os.PathLike, n: int = TEST_SIZE) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    manifest = {}
    for name in TASKS:
        path = os.path.join(str(out_dir), f"testbed_{name}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for row in test_set(name, n):
                f.write(json.dumps(row, ensure_ascii=True) + "\n")
        manifest[name] = {
            "file": os.path.basename(path),
            "seed": TEST_SEEDS[name],
            "n": n,
            "kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in TASKS[name].test_kwargs.items()},
        }
        paths.append(path)
    with open(os.path.join(str(out_dir), "testbed_manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    return paths


# lm-eval hook: ``process_results: !function`` is not needed (a regex filter does the extraction),
# but this keeps the scoring available to YAMLs that prefer it.
def process_results(doc: dict, results: list[str]) -> dict:
    name = doc.get("task") or ("arith_cot" if "####" in doc["target"] else "kv_recall")
    return {"exact_match": float(TASKS[name].score(results[0], doc["target"]))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write the testbed test sets (JSONL).")
    p.add_argument("--write", metavar="DIR", required=True)
    p.add_argument("-n", type=int, default=TEST_SIZE)
    args = p.parse_args(argv)
    for path in write_test_sets(args.write, args.n):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
