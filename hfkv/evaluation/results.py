"""Result files: JSONL rows that sweeps append to and ``eval/make_tables.py`` reads.

A sweep is long and the lead re-runs it with the final policy, so its file must survive an
interruption (every write is a temp file + ``os.replace``), resume where it stopped (rows whose key
is present are skipped unless ``--force``), and say where each row came from (version, commit, date).
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import hfkv
from hfkv.atomic import write_atomic

REPO = Path(__file__).resolve().parents[2]


def write_result_json(path: str | os.PathLike[str], result: dict[str, Any]) -> Path:
    """One result dict as indented JSON with sorted keys (values made JSON-safe), written atomically."""
    return write_atomic(path, json.dumps(json_safe(result), indent=1, sort_keys=True) + "\n")


def script_command(script: str, argv: Sequence[str] | None) -> str:
    """The command line a result file records: ``python <script> <args>`` (``argv`` as the script's main() got
    it; None: the process's own arguments)."""
    return f"python {script} " + " ".join(sys.argv[1:] if argv is None else argv)


def json_safe(v: Any) -> Any:
    """NaN / inf become None / strings so files stay strict JSON."""
    if isinstance(v, float):
        if math.isnan(v):
            return None
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return v
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def dumps_row(row: dict[str, Any]) -> str:
    return json.dumps(json_safe(row), sort_keys=True, allow_nan=False)


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of a JSONL file ([] if absent); a malformed line is an error naming the file and line."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) and not text.endswith("\n"):
                break  # an append cut short by a kill: that row was never finished, so it is re-run
            raise ValueError(f"{path}:{i}: not a JSON row ({exc})") from exc
    return rows


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (``successes`` may be fractional: partial matches)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


class ResultFile:
    """A JSONL result file keyed by some row fields; ``add`` replaces a row with the same key.

    ``match_fields`` (e.g. the method's full ``config``) must also be equal for a row to count as done:
    when a preset's defaults change, its rows are re-run and replaced instead of silently kept. ``normalize``
    maps a row to the form today's code writes before its match fields are compared (rows stored by earlier
    code: :func:`hfkv.evaluation.methods.stored_row_as_today`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        key_fields: Sequence[str],
        match_fields: Sequence[str] = (),
        normalize: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ):
        self.path = Path(path)
        self.key_fields = tuple(key_fields)
        self.match_fields = tuple(match_fields)
        self.normalize = normalize
        self.rows = read_rows(self.path)
        self._index = {self.key(r): self._match(r) for r in self.rows}

    def key(self, row: dict[str, Any]) -> tuple:
        return tuple(json.dumps(json_safe(row.get(k)), sort_keys=True) for k in self.key_fields)

    def _match(self, row: dict[str, Any]) -> tuple:
        row = self.normalize(row) if self.normalize else row
        return tuple(json.dumps(json_safe(row.get(k)), sort_keys=True) for k in self.match_fields)

    def has(self, row: dict[str, Any]) -> bool:
        """Whether a row with ``row``'s key and equal match fields is in the file."""
        return self._index.get(self.key(row)) == self._match(row)

    def add(self, row: dict[str, Any]) -> None:
        k = self.key(row)
        self.rows = [r for r in self.rows if self.key(r) != k] + [json.loads(dumps_row(row))]
        self._index[k] = self._match(row)
        write_atomic(self.path, "".join(dumps_row(r) + "\n" for r in self.rows))

    def append(self, row: dict[str, Any]) -> None:
        """Like ``add`` for a new key, without rewriting the file: one ``write`` of one line in append mode
        (a kill can only leave that last line unfinished, which ``read_rows`` drops). Files of thousands of
        rows (one per example and method) stay cheap to grow."""
        k = self.key(row)
        if k in self._index:
            self.add(row)
            return
        line = (dumps_row(row) + "\n").encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.rows.append(json.loads(line))
        self._index[k] = self._match(row)


@functools.lru_cache(maxsize=1)
def git_commit() -> dict[str, Any]:
    """Commit of the checkout and whether hfkv/ had local changes, read once per process: the code a
    long sweep runs is the code it imported at the start, whatever is committed meanwhile."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=20
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short=12", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", "hfkv"))
    return {"git_commit": commit or None, "git_dirty": dirty if commit else None}


@functools.lru_cache(maxsize=4)
def source_digest(root: Path | None = None) -> str:
    """sha256 (first 16 hex digits) of the package's sources (``*.py``, ``*.cpp``, ``*.h`` under ``root``, default
    the imported hfkv), by relative path and content.

    The code a result came from, whatever git says: a lent GPU's copy of the checkout once named the previous
    call's commit while it ran the new files. To match a digest, check out a commit and call this there."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(p for ext in ("py", "cpp", "h") for p in root.rglob(f"*.{ext}")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def provenance(**extra: Any) -> dict[str, Any]:
    """Fields every result row carries: hfkv version, commit, UTC date, library versions, machine."""
    import torch  # deferred: eval/make_tables.py imports this module without torch
    import transformers  # deferred: eval/make_tables.py imports this module without torch

    return {
        "hfkv_version": hfkv.__version__,
        **dict(git_commit()),
        "source_digest": source_digest(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": machine_name(),
        **extra,
    }


def machine_name(device: str | None = None) -> str:
    """CPU model and core count, or the CUDA device name."""
    import torch  # deferred: eval/make_tables.py imports this module without torch

    if device and str(device).startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))} (CUDA {torch.version.cuda})"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch thread(s)"


def parse_list(text: str | Iterable[str] | None) -> list[str]:
    """``"a,b c"`` or ``["a,b", "c"]`` -> ``["a", "b", "c"]``."""
    if text is None:
        return []
    items = [text] if isinstance(text, str) else list(text)
    return [p.strip() for item in items for p in item.replace(" ", ",").split(",") if p.strip()]
