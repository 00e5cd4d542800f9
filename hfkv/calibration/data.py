"""Calibration problems: the MATH train split, or a local JSONL of the same schema, sampled reproducibly.

DiffKV calibrates on MATH because a dropped symbol breaks a derivation, so thresholds that survive
MATH tend to survive easier text; the train split keeps calibration away from test data. Every
study records the hash of the exact problems it used, so a config can be traced back to its data
and a resumed study can refuse to continue on different data.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hfkv.suggest import did_you_mean

DATASET = "EleutherAI/hendrycks_math"
# Dataset config name -> the `type` field of its rows.
SUBJECTS: dict[str, str] = {
    "algebra": "Algebra",
    "counting_and_probability": "Counting & Probability",
    "geometry": "Geometry",
    "intermediate_algebra": "Intermediate Algebra",
    "number_theory": "Number Theory",
    "prealgebra": "Prealgebra",
    "precalculus": "Precalculus",
}
FIELDS = ("problem", "level", "type", "solution")
LEVELS = (1, 2, 3, 4, 5)


class DataUnavailableError(RuntimeError):
    """The MATH train split cannot be loaded here (offline, no cache): the message says to pass --data-file."""


@dataclass(frozen=True)
class Problem:
    problem: str
    level: str
    type: str
    solution: str

    @property
    def level_number(self) -> int | None:
        """``"Level 3"`` -> 3; MATH has a few ``"Level ?"`` rows, which match no level filter."""
        tail = self.level.rsplit(" ", 1)[-1]
        return int(tail) if tail.isdigit() else None

    def to_dict(self) -> dict[str, str]:
        return {f: getattr(self, f) for f in FIELDS}


def _problem(row: dict, where: str) -> Problem:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with fields {list(FIELDS)}, got {type(row).__name__}")
    missing = [f for f in FIELDS if f not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; each row needs {list(FIELDS)}")
    bad = [f for f in FIELDS if not isinstance(row[f], str) or not row[f].strip()]
    if bad:
        raise ValueError(f"{where}: field(s) {bad} must be non-empty strings")
    return Problem(*(row[f] for f in FIELDS))


def load_jsonl(path: str | Path) -> list[Problem]:
    """Rows of a local JSONL file with the MATH schema (``problem, level, type, solution``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data-file {str(path)!r} does not exist")
    rows = []
    with path.open(encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--data-file {path}:{i}: not valid JSON ({exc.msg})") from exc
            rows.append(_problem(row, f"--data-file {path}:{i}"))
    if not rows:
        raise ValueError(f"--data-file {path} holds no problems")
    return rows


def load_math_train(subjects: Iterable[str] = SUBJECTS) -> list[Problem]:
    """The MATH train split, the given subjects concatenated in the order of :data:`SUBJECTS`."""
    try:
        import datasets  # optional: datasets, the [calibrate] extra
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("loading MATH needs `datasets` (pip install 'hfkv[calibrate]')") from exc
    wanted = set(subjects)
    rows: list[Problem] = []
    for name in SUBJECTS:
        if name not in wanted:
            continue
        try:
            split = datasets.load_dataset(DATASET, name, split="train")
        except (ConnectionError, OSError, datasets.exceptions.DatasetNotFoundError) as exc:
            raise DataUnavailableError(
                f"cannot load {DATASET} ({name}, train split): {exc}. Offline or without the dataset cached, "
                "pass --data-file PATH: a JSONL file with fields problem, level, type, solution "
                "(e.g. calibration/data/math_fixture.jsonl)"
            ) from exc
        rows += [_problem(dict(r), f"{DATASET}/{name}[{i}]") for i, r in enumerate(split)]
    return rows


def parse_subjects(names: Sequence[str] | None) -> list[str]:
    """Dataset config names; also accepts the ``type`` spelling (``"Number Theory"``), case-insensitive."""
    if not names:
        return list(SUBJECTS)
    by_type = {t.lower(): k for k, t in SUBJECTS.items()}
    out = []
    for n in names:
        key = n.strip().lower()
        key = by_type.get(key, key.replace(" ", "_").replace("&", "and"))
        if key not in SUBJECTS:
            hint = did_you_mean(key, SUBJECTS)
            raise ValueError(f"--subjects: {n!r} is not a MATH subject{hint}; allowed: {list(SUBJECTS)}")
        out.append(key)
    return out


def parse_levels(levels: Sequence[int] | None) -> list[int]:
    if not levels:
        return list(LEVELS)
    bad = [v for v in levels if v not in LEVELS]
    if bad:
        raise ValueError(f"--levels: {bad} not allowed; levels are {list(LEVELS)}")
    return sorted(set(levels))


@dataclass
class Selection:
    """The calibration problems and the problems held out from calibration (for the comparison after it)."""

    calibration: list[Problem]
    holdout: list[Problem]
    source: str
    available: int  # rows left after the level/subject filters

    @property
    def hash(self) -> str:
        return data_hash(self.calibration)

    @property
    def holdout_hash(self) -> str:
        return data_hash(self.holdout)


def select(
    rows: Sequence[Problem],
    n_problems: int | None,
    seed: int,
    levels: Sequence[int] | None = None,
    subjects: Sequence[str] | None = None,
    holdout: int = 0,
    source: str = "",
) -> Selection:
    """Filter by level and subject, shuffle with ``seed`` (a private RNG), take ``holdout`` problems
    first and ``n_problems`` calibration problems after them: disjoint, and the same on every machine."""
    lv, subj = parse_levels(levels), {SUBJECTS[s] for s in parse_subjects(subjects)}
    pool = [r for r in rows if r.level_number in lv and r.type in subj]
    if holdout < 0:
        raise ValueError(f"--holdout={holdout} must be >= 0")
    if n_problems is not None and n_problems < 1:
        raise ValueError(f"--n-problems={n_problems} must be >= 1")
    need = holdout + (n_problems or 1)
    if len(pool) < need:
        raise ValueError(
            f"only {len(pool)} problems match --levels {lv} and --subjects {sorted(subj)}, but --holdout "
            f"{holdout} + --n-problems {n_problems or 'all'} need {need}"
        )
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    held = [pool[i] for i in order[:holdout]]
    rest = order[holdout:]
    calib = [pool[i] for i in (rest if n_problems is None else rest[:n_problems])]
    return Selection(calib, held, source, len(pool))


def data_hash(problems: Sequence[Problem]) -> str:
    """sha256 of the problems in order (canonical JSON): same hash, same data."""
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps(p.to_dict(), sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


def load_problems(data_file: str | Path | None, subjects: Sequence[str] | None = None) -> tuple[list[Problem], str]:
    """``(rows, source)``: the local file if given, else the MATH train split of the chosen subjects."""
    if data_file:
        return load_jsonl(data_file), str(data_file)
    return load_math_train(parse_subjects(subjects)), f"{DATASET}:train"
