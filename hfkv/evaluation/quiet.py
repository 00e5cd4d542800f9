"""Timing only on a quiet machine: the load-average check of ``hfkv bench`` and ``eval/cpu_cache_figures.py``.

A speed ratio taken while other processes compete for the cores is not a result. Before timing, the
1-minute load average (:func:`os.getloadavg`) must be below ``--max-load`` (default 0.5), else the run
is refused (:class:`BusyMachine`, exit status 2) unless ``--force-busy`` is given; ``--wait-quiet S``
polls for up to ``S`` seconds first (the load a previous process left decays by ``exp(-t / 60 s)``).

After the timing the run's own threads have pushed the load up (one busy thread for a minute adds about
0.63), so the check at the end waits for that load to decay as it would on an otherwise idle machine —
``60 s * ln(load / max_load)`` plus a margin, polling every 5 s — and compares what is left with
``--max-load``. A load that stays above it means something else ran; the result is marked busy.

Every result records :func:`start`'s and :func:`finish`'s dict (:data:`RECORD_FIELDS`): thread counts,
``os.cpu_count()``, the loads, whether each end was quiet, and ``busy``. :func:`verdict` says why a
record is not a result (``None``: it is one); ``eval/make_tables.py`` prints no speed figure from such a
result.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

from hfkv.cli_args import UsageError

DEFAULT_MAX_LOAD = 0.5
POLL_S = 5.0  # Linux updates the load average every 5 s
SETTLE_MARGIN_S = 15.0
SETTLE_MAX_S = 600.0
RECORD_FIELDS = (
    "max_load cpu_count threads load_before waited_s quiet_before load_at_end settle_s load_after quiet_after "
    "force_busy busy"
).split()

_sleep = time.sleep  # tests replace it


class BusyMachine(UsageError):
    """The load average is not below ``--max-load`` before timing (and ``--force-busy`` was not given)."""


def load_average() -> float | None:
    """The 1-minute load average, or None where the platform has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def _round(load: float | None) -> float | None:
    return None if load is None else round(load, 2)


# ------------------------------------------------------------------------------------------ threads
def parse_threads(text: str | int | list, cpu_count: int | None = None) -> list[int]:
    """``"1,all"`` -> ``[1, os.cpu_count()]``: positive integers or ``all``, comma-separated, duplicates
    dropped (on a one-core machine ``1,all`` is ``[1]``); ValueError on anything else."""
    items = [str(t) for t in text] if isinstance(text, (list, tuple)) else str(text).split(",")
    parts = [p.strip() for p in items if p.strip()]
    if not parts:
        raise ValueError(f"{text!r} is empty; give thread counts, e.g. 1,all")
    out: list[int] = []
    for part in parts:
        if str(part).lower() == "all":
            n = cpu_count or os.cpu_count() or 1
        else:
            try:
                n = int(part)
            except (TypeError, ValueError):
                raise ValueError(f"{part!r} is not a positive integer or 'all' (thread counts, e.g. 1,all)") from None
            if n < 1:
                raise ValueError(f"{part!r} must be a positive integer or 'all' (thread counts, e.g. 1,all)")
        if n not in out:
            out.append(n)
    return out


def thread_counts(text: str) -> list[int]:
    """``type=`` for ``--threads``: :func:`parse_threads` with argparse's error."""
    try:
        return parse_threads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


thread_counts.__name__ = "thread counts"


def add_arguments(parser, default_threads: str | None = "1,all") -> None:
    """``--threads``, ``--max-load``, ``--wait-quiet``, ``--force-busy`` on ``parser`` (or an argument group)."""
    shown = default_threads or "1,all on CPU, all on CUDA"
    parser.add_argument(
        "--threads",
        type=thread_counts,
        default=default_threads,
        help=f"torch CPU thread counts, each timed as its own group; 'all' = os.cpu_count() (default: {shown})",
    )
    parser.add_argument(
        "--max-load",
        type=float,
        default=DEFAULT_MAX_LOAD,
        help="time only when the 1-minute load average is below this; above it after the run marks the "
        f"result busy (default: {DEFAULT_MAX_LOAD})",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before timing, wait up to this long for the load to fall below --max-load (default: 0)",
    )
    parser.add_argument(
        "--force-busy",
        action="store_true",
        help="time on a busy machine anyway; the result is marked busy and tables print no speed from it",
    )


# ------------------------------------------------------------------------------------------ checks
def wait_below(max_load: float, wait_s: float, poll_s: float = POLL_S) -> tuple[float | None, float]:
    """``(load, seconds waited)``: poll every ``poll_s`` until the load is below ``max_load`` or ``wait_s``
    seconds have passed."""
    load, waited = load_average(), 0.0
    while (load is None or load >= max_load) and waited < wait_s:
        step = min(poll_s, wait_s - waited)
        _sleep(step)
        waited += step
        load = load_average()
    return load, waited


def start(
    threads: list[int], max_load: float = DEFAULT_MAX_LOAD, wait_s: float = 0.0, force_busy: bool = False
) -> dict[str, Any]:
    """The record of a run about to be timed; :class:`BusyMachine` if the load is not below ``max_load``
    (after waiting up to ``wait_s`` seconds) and ``force_busy`` is off."""
    load, waited = wait_below(max_load, wait_s)
    quiet = load is not None and load < max_load
    if not quiet and not force_busy:
        now = "no load average on this platform" if load is None else f"1-minute load average {load:.2f}"
        raise BusyMachine(
            None,
            f"busy machine: {now}, not below --max-load {max_load:g} (waited {waited:.0f} s); nothing was timed. "
            "Wait for a quiet machine (--wait-quiet SECONDS) or time anyway with --force-busy (the result is "
            "marked busy)",
        )
    return {
        "max_load": max_load,
        "cpu_count": os.cpu_count(),
        "threads": list(threads),
        "load_before": _round(load),
        "waited_s": round(waited, 1),
        "quiet_before": quiet,
        "load_at_end": None,
        "settle_s": None,
        "load_after": None,
        "quiet_after": None,
        "force_busy": bool(force_busy),
        "busy": not quiet,
    }


def settle_limit(load: float, max_load: float) -> float:
    """Seconds the run's own load needs to decay below ``max_load`` on an otherwise idle machine (plus a
    margin): the 1-minute average falls by ``exp(-t / 60 s)`` once nothing runs."""
    if load < max_load:
        return 0.0
    return min(SETTLE_MAX_S, 60.0 * math.log(max(load, 1e-9) / max(max_load, 1e-9)) + SETTLE_MARGIN_S)


def finish(record: dict[str, Any], settle: bool | None = None) -> dict[str, Any]:
    """Complete ``record`` (in place) once the timing is over: the load at the end, then — unless the run
    is busy already (or ``settle`` is False) — the load after the run's own share has decayed, and
    ``busy`` when that is still not below ``max_load``."""
    max_load = record["max_load"]
    end = load_average()
    record["load_at_end"] = _round(end)
    if settle is None:
        settle = not record["busy"]
    limit = settle_limit(end, max_load) if settle and end is not None else 0.0
    after, waited = end, 0.0
    while after is not None and after >= max_load and waited < limit:
        step = min(POLL_S, limit - waited)
        _sleep(step)
        waited += step
        after = load_average()
    record["settle_s"] = round(waited, 1)
    record["load_after"] = _round(after)
    record["quiet_after"] = after is not None and after < max_load
    record["busy"] = bool(record["busy"] or not record["quiet_after"])
    return record


def verdict(record: dict[str, Any] | None) -> str | None:
    """Why timings under ``record`` are not a result (``None``: they are one)."""
    if not record or record.get("load_before") is None:
        return "load not recorded"
    if record.get("busy"):
        return "busy machine"
    if record.get("load_after") is None:
        return "load after the run not recorded (interrupted?)"
    return None


def describe(record: dict[str, Any] | None) -> str:
    """``load average 0.12 before / 0.31 after, max 0.5`` (or what of it was recorded)."""
    if not record or record.get("load_before") is None:
        return "load not recorded"
    after = record.get("load_after")
    tail = f" / {after:.2f} after" if after is not None else ", none after"
    return f"load average {record['load_before']:.2f} before{tail}, max {record['max_load']:g}"
