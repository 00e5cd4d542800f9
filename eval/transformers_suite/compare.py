"""Of the tests that pass with DynamicCache, how many pass with a TriStateCache preset, and why the others do not.

Only the baseline's passes count, in the files the preset's run covered: a test that fails or skips with
DynamicCache here (the Hub is offline, no GPU, a test newer or older than the library) says nothing about hfkv. A
test that built no cache in the preset's run (``hfkv_caches`` 0) is "not exercised": its pass or failure is not
the cache's. Failures are grouped by their first message line. Prints the summary and writes it as JSON (default:
beside the preset's JSON, ``<preset>.compare.json``).

A run restricted by ``run.py --only-exercised REF_JSON`` left out the tests that built no DynamicCache in REF_JSON
(its ``ref_not_exercised``): the substitution cannot change a test that builds none, so each of them that the
baseline has counts as not exercised, with the baseline's outcome, in ``preset_counts`` too. Every count then has the
meaning, and the keys, of an unrestricted run's; ``only_exercised`` adds the reference and how many were filled in.

    python -m eval.transformers_suite.compare hfkv-out/transformers_suite/{none,full}.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from hfkv.atomic import write_atomic

COUNT_KEY = "hfkv_caches"


def _group_key(message: str) -> str:
    """A message with its numbers and addresses blanked, so that one cause is one group."""
    return re.sub(r"0x[0-9a-f]+|\d+(\.\d+)?", "#", message)[:200] or "(no message)"


def _counts(tests: dict[str, dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for rec in tests.values():
        counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
    return dict(sorted(counts.items()))


def compare(baseline: dict[str, Any], preset: dict[str, Any]) -> dict[str, Any]:
    base, other = baseline["tests"], preset["tests"]
    preset_counts, only = preset["counts"], preset.get("only_exercised")
    if only is not None:  # restricted run: its left-out tests are not exercised, the baseline's outcome stands
        filled = {n: {**base[n], COUNT_KEY: 0} for n in preset["ref_not_exercised"] if n not in other and n in base}
        other = {**other, **filled}
        preset_counts, only = _counts(other), {**only, "filled_from_baseline": len(filled)}
    files = sorted(preset.get("files") or {n.split("::")[0] for n in other})  # a run of some files: only those
    passed = sorted(n for n, r in base.items() if r["outcome"] == "passed" and n.split("::")[0] in files)
    still = [n for n in passed if other.get(n, {}).get("outcome") == "passed"]
    lost = [n for n in passed if other.get(n, {}).get("outcome") != "passed"]
    exercised = [n for n in passed if other.get(n, {}).get(COUNT_KEY, 0) > 0]
    groups: dict[str, dict[str, Any]] = {}
    for n in lost:
        rec = other.get(n, {"outcome": "missing", "message": "not in the preset's run"})
        g = groups.setdefault(_group_key(rec["message"]), {"message": rec["message"], "outcomes": {}, "tests": []})
        g["outcomes"][rec["outcome"]] = g["outcomes"].get(rec["outcome"], 0) + 1
        g["tests"].append(n)
    return {
        "baseline": baseline["preset"],
        "preset": preset["preset"],
        "transformers": preset.get("transformers"),
        "files": files,
        "baseline_counts": baseline["counts"],
        "preset_counts": preset_counts,
        "pass_with_dynamic": len(passed),
        "of_those_pass_with_preset": len(still),
        "exercised": len(exercised),
        "exercised_pass_with_preset": sum(other[n]["outcome"] == "passed" for n in exercised),
        "not_exercised": len(passed) - len(exercised),
        "failure_groups": sorted(groups.values(), key=lambda g: -len(g["tests"])),
        **({"only_exercised": only} if only is not None else {}),
    }


def render(s: dict[str, Any], max_tests: int = 5) -> str:
    lines = [
        f"transformers {s['transformers']}: of the {s['pass_with_dynamic']} tests that pass with DynamicCache, "
        f"{s['of_those_pass_with_preset']} pass with TriStateCache({s['preset']!r}) ({len(s['files'])} test files).",
        f"  exercised (built a cache with the preset): {s['exercised']}, of which "
        f"{s['exercised_pass_with_preset']} pass; not exercised: {s['not_exercised']}",
        f"  baseline counts: {s['baseline_counts']}; preset counts: {s['preset_counts']}",
    ]
    if "only_exercised" in s:
        o = s["only_exercised"]
        lines.append(
            f"  restricted run: the {o['selected']} tests exercised in {o['ref']} (preset {o['preset']!r}); "
            f"{o['filled_from_baseline']} not-exercised tests counted with their baseline outcome"
        )
    for g in s["failure_groups"]:
        lines.append(f"\n{len(g['tests'])} x {g['outcomes']}: {g['message']}")
        lines += [f"    {n}" for n in g["tests"][:max_tests]]
        if len(g["tests"]) > max_tests:
            lines.append(f"    ... and {len(g['tests']) - max_tests} more")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("baseline", type=Path, help="run.py's JSON of --preset none")
    p.add_argument("preset", type=Path, help="run.py's JSON of a preset")
    p.add_argument("--out", type=Path, help="where to write the summary JSON")
    p.add_argument("--max-tests", type=int, default=5, help="test ids printed per failure group")
    args = p.parse_args(argv)
    summary = compare(json.loads(args.baseline.read_text()), json.loads(args.preset.read_text()))
    print(render(summary, args.max_tests))
    out = args.out or args.preset.with_suffix(".compare.json")
    write_atomic(out, json.dumps(summary, indent=1) + "\n")
    print(f"\n{out}")


if __name__ == "__main__":
    main()
