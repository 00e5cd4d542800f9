"""Synthetic tasks of the testbed: tasks where losing the wrong cached tokens costs accuracy.

Every task is deterministic by seed (a private ``random.Random``, never global state) and returns
examples ``{"prompt": str, "target": str}``. The model's continuation of ``prompt`` is expected to
be ``target`` followed by the stop string ``"\\n"``. Lengths are in tokens of the testbed tokenizer
(``hfkv.testbed.tokenizer``: one token per word, key, one- or two-digit number or symbol).

``kv_recall`` -- long-context key-value recall::

    - bofe 4821
    the river holds a quiet lamp near the old road
    - tazi 9041
    ...
    ? tazi 9041            <- answered questions (records from anywhere in the context)
    ? bofe                 <- final question: the prompt ends with the key

    target: " 4821"

  Keys are distinct words of ``KEY_WORDS`` (one token each), values 4-digit numbers (two tokens);
  the record asked by the final question lies in the first third of the context (``early_frac``)
  and is asked nowhere else, so a cache that evicted (or badly quantized) that record cannot
  answer. Extraction: the first run of digits of the prediction's first line.

``arith_cot`` -- multi-step arithmetic with a generated chain of thought::

    let q = 7
    the green kettle sings        <- filler lines (optional)
    let k = 3
    let a = k + 5
    let b = a - q
    let c = b + 4
    ? c

    target: " a = k + 5 ; k = 3 ; a = 3 + 5 = 8 ; b = a - q ; q = 7 ; b = 8 - 7 = 1 ; c = b + 4 ; c = 1 + 4 = 5 #### 5"

  Each step restates its definition, recalls the named constants it uses (defined in the prompt,
  possibly far back), substitutes the values (those and the previous step's result) and computes;
  every intermediate value stays in 0..``max_value``. Recalling ``k = 3`` is the same lookup as
  restating a definition (the token after ``k =``); substituting without it would need the name
  fetched from a few tokens back *and* looked up in one step, which a tiny model does not learn.
  The prediction must end with ``#### <answer>`` as in GSM8K. Extraction: the number after the
  first ``####``.

Examples also carry ``segments``: the prompt and target cut into ``(text, supervised)`` pieces,
supervised where the text is predictable (answers), which the training script uses for its loss.

Test sets: ``python -m hfkv.testbed.tasks --write eval/tasks`` writes ``testbed_<task>.jsonl``
(``TEST_SEEDS`` / ``TEST_SIZE`` / each task's ``test_kwargs``) and a manifest.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from hfkv.testbed.tokenizer import FILLER_WORDS, KEY_WORDS, count_tokens

STOP = "\n"


def _filler_line(rng: random.Random) -> str:
    return " ".join(rng.choice(FILLER_WORDS) for _ in range(rng.randint(3, 9)))


def _pick(rng: random.Random, value: int | tuple[int, int] | list[int]) -> int:
    if isinstance(value, (tuple, list)):
        return rng.randint(int(value[0]), int(value[1]))
    return int(value)


def _interleave(rng: random.Random, items: list[str], fillers: list[str], shuffle: bool) -> list[str]:
    """``items`` (shuffled or in order) with ``fillers`` at random places."""
    if shuffle:
        out = items + fillers
        rng.shuffle(out)
        return out
    slots = sorted(rng.randint(0, len(items)) for _ in fillers)
    out: list[str] = []
    k = 0
    for j, item in enumerate(items + [None]):
        while k < len(slots) and slots[k] == j:
            out.append(fillers[k])
            k += 1
        if item is not None:
            out.append(item)
    return out


# --------------------------------------------------------------------------------------------
# kv_recall
# --------------------------------------------------------------------------------------------


def kv_recall_example(
    rng: random.Random,
    length: int | tuple[int, int] = (400, 640),
    n_questions: int = 4,
    tokens_per_record: int = 16,
    early_frac: float = 1 / 3,
    question_frac: float | None = None,
) -> dict:
    """One kv_recall example of about ``length`` prompt tokens (any length works, e.g. 4000).

    ``question_frac`` (training) asks about that fraction of the records instead of
    ``n_questions`` (denser supervision).
    """
    total = _pick(rng, length)
    if question_frac is None:
        n_rec = max(n_questions + 2, round(total / tokens_per_record))
    else:
        n_rec = max(3, round(total / tokens_per_record))
        n_questions = min(n_rec - 1, max(1, round(question_frac * n_rec)))
    n_rec = min(n_rec, len(KEY_WORDS))
    keys = rng.sample(KEY_WORDS, n_rec)
    values = [str(rng.randint(1000, 9999)) for _ in keys]
    records = [f"- {k} {v}" for k, v in zip(keys, values, strict=True)]
    body_target = max(0, total - 6 * n_questions)
    used = sum(count_tokens(r) + 1 for r in records)
    fillers: list[str] = []
    while used < body_target:
        line = _filler_line(rng)
        fillers.append(line)
        used += count_tokens(line) + 1
    lines = _interleave(rng, records, fillers, shuffle=True)
    where = {line: i for i, line in enumerate(lines)}
    order = sorted(range(n_rec), key=lambda i: where[records[i]])
    early = order[: max(1, int(early_frac * n_rec))]
    final = rng.choice(early)
    others = rng.sample([i for i in range(n_rec) if i != final], n_questions - 1)
    segments = [("".join(line + "\n" for line in lines), False)]
    for i in others:
        segments += [(f"? {keys[i]}", False), (f" {values[i]}\n", True)]
    segments.append((f"? {keys[final]}", False))
    target = f" {values[final]}"
    prompt = "".join(t for t, _ in segments)
    return {"prompt": prompt, "target": target, "segments": segments + [(target + STOP, True)]}


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
    steps: int | tuple[int, int] = (3, 6),
    consts: int | tuple[int, int] = 0,
    filler: int | tuple[int, int] = (4, 8),
    const_prob: float = 0.5,
    max_const: int = 9,
    max_value: int = 99,
    recall: bool = True,
) -> dict:
    """One arith_cot example: named constants, a chain of ``steps`` operations, filler lines.

    ``recall=False`` drops the recalled constants from the chain of thought (the format of the
    first training stages of the shipped model; harder, see the module docstring)."""
    n_steps = min(_pick(rng, steps), len(CHAIN_NAMES))
    n_consts = min(_pick(rng, consts), len(CONST_NAMES))
    names = rng.sample(CONST_NAMES, n_consts)
    cval = {c: rng.randint(1, max_const) for c in names}
    defs = [f"let {c} = {cval[c]}" for c in names]
    cot: list[str] = []
    prev_name, prev_val = None, None
    for i in range(n_steps):
        v = CHAIN_NAMES[i]
        if i > 0:
            a_name, a_val = prev_name, prev_val
        elif names:
            a_name = rng.choice(names)
            a_val = cval[a_name]
        else:
            a_val = rng.randint(1, 9)
            a_name = str(a_val)
        if names and rng.random() < const_prob:
            b_name = rng.choice(names)
            b_val = cval[b_name]
        else:
            b_val = rng.randint(1, 9)
            b_name = str(b_val)
        ops = [o for o, r in (("+", a_val + b_val), ("-", a_val - b_val)) if 0 <= r <= max_value]
        op = rng.choice(ops)
        res = a_val + b_val if op == "+" else a_val - b_val
        defs.append(f"let {v} = {a_name} {op} {b_name}")
        if recall:
            recalls = [f"{c} = {cval[c]}" for c in dict.fromkeys((a_name, b_name)) if c in cval]
            cot.append(" ; ".join([f"{v} = {a_name} {op} {b_name}", *recalls, f"{v} = {a_val} {op} {b_val} = {res}"]))
        else:
            cot.append(f"{v} = {a_name} {op} {b_name} = {a_val} {op} {b_val} = {res}")
        prev_name, prev_val = v, res
    fillers = [_filler_line(rng) for _ in range(_pick(rng, filler))]
    lines = _interleave(rng, defs, fillers, shuffle=False)  # definitions keep their order
    prompt = "".join(line + "\n" for line in lines) + f"? {prev_name}\n"
    target = " " + " ; ".join(cot) + f" #### {prev_val}"
    return {"prompt": prompt, "target": target, "segments": [(prompt, False), (target + STOP, True)]}


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
    example: Callable[..., dict]  # (rng, **knobs) -> {"prompt", "target", "segments"}
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
        max_new_tokens=4,
        test_kwargs={"length": (400, 640), "n_questions": 4},
    ),
    "arith_cot": Task(
        "arith_cot",
        arith_cot_example,
        arith_cot_extract,
        max_new_tokens=128,
        test_kwargs={"steps": (3, 6), "consts": 0, "filler": (4, 8)},
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
