"""Run transformers' vendored cache and generation tests, as they are (``--preset none``) or on a TriStateCache.

One pytest per test file (``-n 2`` workers, the plugin of ``plugin.py``), offline, with transformers' own default
skips: ``@slow`` tests skip while ``RUN_SLOW`` is unset (it is removed here), accelerator tests skip on a CPU. Also
off, because they cannot run here: the pipeline tests (tiny models from the Hub: ``RUN_PIPELINE_TESTS=0``) and the
multi-process tensor-parallel, expert-parallel and FSDP tests (``RUN_*_TESTS=0``; their helpers are not vendored,
upstream/SOURCE.md). Each file's outcomes go to ``hfkv-out/transformers_suite/parts/<preset>/`` first (``--resume``
reuses them), then all of them to ``<out>/<preset>.json``, atomically. The default ``--out`` is
``hfkv-out/transformers_suite`` in the working directory (gitignored); the committed results are written only by
naming ``--out eval/results/transformers_suite``.

``--only-exercised REF_JSON`` runs only the tests that built a DynamicCache (``hfkv_caches`` > 0) in an earlier run
REF_JSON (any preset's, the baseline's too: whether it is 0 does not depend on the preset), about a fifth of them; a
file with none is not run. The other tests cannot be changed by the substitution (it acts on DynamicCaches built,
and they build none), so compare.py counts them as not exercised with their baseline outcome. The output records the
reference (``only_exercised``: path, sha256, preset) and the ids of its not-exercised tests (``ref_not_exercised``),
so that compare.py needs nothing else.

    python -m eval.transformers_suite.run --preset none
    python -m eval.transformers_suite.run --preset full --files tests/utils/test_cache_utils.py
    python -m eval.transformers_suite.run --preset evict --only-exercised eval/results/transformers_suite/full.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hfkv.atomic import write_atomic

HERE = Path(__file__).resolve().parent
UPSTREAM = HERE / "upstream"
REPO = HERE.parent.parent
TRANSFORMERS_VERSION = "5.23.0"  # the version upstream/ was vendored for (upstream/SOURCE.md)
MODELS = ("llama", "qwen3", "qwen2", "mistral", "gemma2", "gemma3", "bart")
FILES = (
    "tests/utils/test_cache_utils.py",
    "tests/generation/test_utils.py",
    *(f"tests/models/{m}/test_modeling_{m}.py" for m in MODELS),
)
SCRATCH = Path("hfkv-out/transformers_suite")
COUNT_KEY = "hfkv_caches"  # plugin.py's: DynamicCaches a test built
# transformers' switches for what cannot run here (module docstring); RUN_SLOW is removed instead.
ENV_OFF = ("RUN_PIPELINE_TESTS", "RUN_TENSOR_PARALLEL_TESTS", "RUN_EXPERT_PARALLEL_TESTS", "RUN_FSDP_TESTS")


def _env(preset: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RUN_SLOW", "HFKV_SUITE_PRESET")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **dict.fromkeys(ENV_OFF, "0")})
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ (pytest's rewritten asserts too) in the vendored tree
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))  # -p eval.transformers_...
    if preset != "none":
        env["HFKV_SUITE_PRESET"] = preset
    return env


def _file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def load_reference(path: Path, files: list[str]) -> tuple[dict[str, Any], dict[str, list[str]], list[str]]:
    """``--only-exercised``: the reference's summary, each file's exercised tests, and its not-exercised tests."""
    raw = path.read_bytes()
    ref = json.loads(raw)
    covered = set(ref.get("files") or map(_file_of, ref["tests"]))
    missing = [f for f in files if f not in covered]
    if missing:
        raise SystemExit(f"--only-exercised {path}: that run did not cover {missing}")
    wanted = set(files)
    selected: dict[str, list[str]] = {f: [] for f in files}
    not_exercised = []
    for nodeid, rec in sorted(ref["tests"].items()):
        if _file_of(nodeid) in wanted:
            if rec.get(COUNT_KEY, 0) > 0:
                selected[_file_of(nodeid)].append(nodeid)
            else:
                not_exercised.append(nodeid)
    info = {
        "ref": str(path),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "preset": ref.get("preset"),
        "transformers": ref.get("transformers"),
        "selected": sum(map(len, selected.values())),
        "not_exercised": len(not_exercised),
    }
    return info, selected, not_exercised


def run_file(rel: str, preset: str, part: Path, workers: int, timeout: int, extra: list[str]) -> dict[str, Any]:
    """One pytest over one vendored test file; its outcomes as the plugin wrote them."""
    part.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pytest", rel, "-q", "-p", "eval.transformers_suite.plugin",
        "-p", "no:cacheprovider",  # nothing written into the vendored tree
        "-c", "pyproject.toml", "--rootdir", ".", f"--hfkv-report={part.resolve()}", f"--timeout={timeout}",
        *(["-n", str(workers)] if workers > 0 else []), *extra,
    ]  # fmt: skip
    log = part.with_suffix(".log")
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, cwd=UPSTREAM, env=_env(preset), stdout=fh, stderr=subprocess.STDOUT).returncode
    if not part.is_file():
        raise SystemExit(f"{rel}: pytest exited {rc} without a report; its output: {log}")
    return json.loads(part.read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, help="'none' (DynamicCache, the baseline) or an hfkv preset name")
    p.add_argument("--files", nargs="+", default=list(FILES), help="test files, relative to upstream/")
    p.add_argument("--out", type=Path, default=SCRATCH, help=f"folder of <preset>.json (default {SCRATCH})")
    p.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers (0: none)")
    p.add_argument("--timeout", type=int, default=900, help="seconds one test may take (pytest-timeout)")
    p.add_argument("--resume", action="store_true", help="reuse the files' outcomes from an earlier run")
    p.add_argument(
        "--any-version", action="store_true", help=f"run on a transformers other than {TRANSFORMERS_VERSION}"
    )
    p.add_argument(
        "--only-exercised",
        type=Path,
        metavar="REF_JSON",
        help="run only the tests with hfkv_caches > 0 in this earlier run's JSON (compare.py: the rest not exercised)",
    )
    p.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --), e.g. -- -k cache")
    args = p.parse_args(argv)

    import transformers

    if transformers.__version__ != TRANSFORMERS_VERSION and not args.any_version:
        p.error(f"upstream/ holds transformers {TRANSFORMERS_VERSION}'s tests; installed: {transformers.__version__}")
    unknown = [f for f in args.files if not (UPSTREAM / f).is_file()]
    if unknown:
        p.error(f"not in {UPSTREAM}: {unknown}")

    only: dict[str, Any] | None = None
    parts = SCRATCH / "parts" / args.preset
    if args.only_exercised is not None:
        only, selected, ref_not_exercised = load_reference(args.only_exercised, args.files)
        parts = parts.with_name(f"{args.preset}.only-{only['sha256'][:12]}")  # --resume: this reference's parts only
        print(f"--only-exercised {args.only_exercised}: {only['selected']} tests of {len(args.files)} files")

    start, tests, per_file = time.time(), {}, {}
    for rel in args.files:
        part = parts / (rel.replace("/", "__") + ".json")
        t0 = time.time()
        extra = args.pytest_args
        if only is not None:
            if not selected[rel]:
                per_file[rel] = {"counts": {}, "wall_s": 0.0, "selected": 0}
                print(f"{rel}: not run, no exercised test in the reference", flush=True)
                continue
            ids = part.with_suffix(".ids")
            ids.parent.mkdir(parents=True, exist_ok=True)
            ids.write_text("\n".join(selected[rel]) + "\n")
            extra = [f"--hfkv-only={ids.resolve()}", *extra]
        if args.resume and part.is_file():
            data = json.loads(part.read_text())
        else:
            data = run_file(rel, args.preset, part, args.workers, args.timeout, extra)
        tests.update(data["tests"])
        per_file[rel] = {"counts": data["counts"], "wall_s": round(time.time() - t0, 1)}
        if only is not None:
            per_file[rel]["selected"] = len(selected[rel])
        print(f"{rel}: {data['counts']} ({per_file[rel]['wall_s']} s)", flush=True)

    counts: dict[str, int] = {}
    for rec in tests.values():
        counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
    result = {
        "preset": args.preset,
        "transformers": transformers.__version__,
        "workers": args.workers,
        "wall_s": round(time.time() - start, 1),
        **({"only_exercised": only} if only is not None else {}),
        "counts": dict(sorted(counts.items())),  # a restricted run's: of the tests it ran
        "files": per_file,
        "tests": dict(sorted(tests.items())),
        **({"ref_not_exercised": ref_not_exercised} if only is not None else {}),
    }
    out = write_atomic(args.out / f"{args.preset}.json", json.dumps(result, indent=1) + "\n")
    print(f"{out}: {len(tests)} tests, {result['counts']}, {result['wall_s']} s")


if __name__ == "__main__":
    main()
