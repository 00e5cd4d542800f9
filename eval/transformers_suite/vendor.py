"""Re-create ``upstream/`` from transformers' 5.23.0 sdist and a git snapshot, and write its sha256 manifest.

Why a script: the vendored tree mixes two sources (``upstream/SOURCE.md`` says why), and which file came from where
must stay reproducible and checkable. ``--check`` verifies the committed tree against ``MANIFEST.sha256`` only.

    python -m eval.transformers_suite.vendor --sdist /tmp/tf-sdist/transformers-5.23.0 \\
        --git-dir /work/.mirror/zucchini-nlp+transformers/repo --rev decba1d2ea4ed3cbf0495d1828abad4b2dba1846
    python -m eval.transformers_suite.vendor --check
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parent / "upstream"
MANIFEST = UPSTREAM / "MANIFEST.sha256"
MODELS = ("llama", "qwen3", "qwen2", "mistral", "gemma2", "gemma3", "bart")

# Taken from the 5.23.0 sdist, byte for byte: everything it carries that the suite imports.
SDIST_FILES = (
    "LICENSE",
    "pyproject.toml",  # its [tool.pytest.ini_options]: markers, filterwarnings
    "tests/test_modeling_common.py",
    "tests/test_configuration_common.py",
    "tests/test_pipeline_mixin.py",
    "tests/test_training_mixin.py",
    "tests/test_tensor_parallel_mixin.py",
    "tests/test_fsdp_mixin.py",
)
# The sdist carries none of these: taken from the git snapshot at --rev.
GIT_FILES = (
    "conftest.py",
    "utils/test_module/__init__.py",
    "utils/test_module/custom_configuration.py",  # tests/utils/test_configuration_utils.py imports it
    "tests/__init__.py",
    "tests/causal_lm_tester.py",
    "tests/multimodal_tester.py",
    "tests/vlm_tester.py",
    "tests/exporters/__init__.py",
    "tests/exporters/test_export.py",
    "tests/generation/__init__.py",
    "tests/generation/test_utils.py",
    "tests/utils/__init__.py",
    "tests/utils/test_cache_utils.py",
    "tests/utils/test_configuration_utils.py",
    "tests/utils/tiny_model_summary.json",  # read by tests/test_pipeline_mixin.py at import
    "tests/models/__init__.py",
    *(f"tests/models/{m}/{f}" for m in MODELS for f in ("__init__.py", f"test_modeling_{m}.py")),
)
# Written here, not upstream (SOURCE.md): kept as they are when re-vendoring.
LOCAL_FILES = ("tests/distributed_testing_utils.py", "SOURCE.md")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest() -> None:
    """``sha256  path`` for every file of upstream/ but the manifest itself (``sha256sum -c`` reads it)."""
    files = sorted(p for p in UPSTREAM.rglob("*") if p.is_file() and p != MANIFEST and "__pycache__" not in p.parts)
    MANIFEST.write_text("".join(f"{_sha256(p)}  {p.relative_to(UPSTREAM).as_posix()}\n" for p in files))


def check() -> list[str]:
    """The manifest's entries whose file is missing or differs."""
    bad = []
    for line in MANIFEST.read_text().splitlines():
        digest, rel = line.split("  ", 1)
        path = UPSTREAM / rel
        if not path.is_file() or _sha256(path) != digest:
            bad.append(rel)
    return bad


def vendor(sdist: Path, git_dir: Path, rev: str) -> None:
    for rel in SDIST_FILES:
        (UPSTREAM / rel).parent.mkdir(parents=True, exist_ok=True)
        (UPSTREAM / rel).write_bytes((sdist / rel).read_bytes())
    for rel in GIT_FILES:
        blob = subprocess.run(
            ["git", f"--git-dir={git_dir}", "show", f"{rev}:{rel}"], check=True, capture_output=True
        ).stdout
        (UPSTREAM / rel).parent.mkdir(parents=True, exist_ok=True)
        (UPSTREAM / rel).write_bytes(blob)
    missing = [rel for rel in LOCAL_FILES if not (UPSTREAM / rel).is_file()]
    if missing:
        sys.exit(f"vendor: the local files {missing} are not there (they are written by hand, see SOURCE.md)")
    write_manifest()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sdist", type=Path, help="the unpacked transformers-5.23.0 sdist")
    p.add_argument("--git-dir", type=Path, help="a bare git snapshot of transformers")
    p.add_argument("--rev", help="the revision of --git-dir to take the other files from")
    p.add_argument("--check", action="store_true", help="only verify upstream/ against MANIFEST.sha256")
    args = p.parse_args(argv)
    if args.check:
        bad = check()
        print("\n".join(f"differs or missing: {rel}" for rel in bad) or f"upstream/ matches {MANIFEST.name}")
        sys.exit(1 if bad else 0)
    if not (args.sdist and args.git_dir and args.rev):
        p.error("--sdist, --git-dir and --rev are needed (or --check)")
    vendor(args.sdist, args.git_dir, args.rev)


if __name__ == "__main__":
    main()
