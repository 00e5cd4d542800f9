"""A user's run of ``hfkv demo``, ``hfkv bench`` or ``hfkv eval`` with the defaults (and the documented examples)
leaves a checkout of this repository clean: what it writes goes under ``hfkv-out/<command>/`` in the working
directory (gitignored), never over the committed results in ``eval/results/`` (regenerated only by naming them:
``make results-demo``, ``make results-bench``).

Each command runs at toy size through :func:`hfkv.cli.main` (the console script's code, installed from this
tree) with the working directory set to a fresh ``git clone`` of the repository, and ``git status`` of the clone
must be empty afterwards."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import hfkv
from hfkv.cli import main
from hfkv.evaluation import quiet

REPO = Path(__file__).resolve().parents[1]
IGNORE_LINE = "/hfkv-out/"

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs git and a git checkout"
)


def git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)


def status(cwd: Path, *extra: str) -> str:
    res = git(cwd, "status", "--porcelain", *extra)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.fixture
def clone(tmp_path, monkeypatch) -> Path:
    """A clean clone of the repository's last commit as the working directory. A commit older than the
    .gitignore line gets it in .git/info/exclude (the same rule, without modifying a tracked file)."""
    dest = tmp_path / "repo"
    res = subprocess.run(["git", "clone", "--quiet", "--shared", str(REPO), str(dest)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    if git(dest, "check-ignore", "-q", "hfkv-out/bench/x.json").returncode != 0:
        with open(dest / ".git" / "info" / "exclude", "a", encoding="utf-8") as fh:
            fh.write(f"{IGNORE_LINE}\n")
    assert status(dest) == ""
    monkeypatch.chdir(dest)
    return dest


def test_the_commands_run_from_this_tree_not_the_clone(clone):
    assert Path(hfkv.__file__).resolve().parent == REPO / "hfkv"


def test_this_checkout_ignores_the_user_folder():
    """The .gitignore a user gets with the repository ignores hfkv-out/ (the clone above may predate it)."""
    res = git(REPO, "check-ignore", "-q", "hfkv-out/bench/x.json")
    assert res.returncode == 0, f"add {IGNORE_LINE} to .gitignore"


def test_demo_writes_nothing_by_default(clone, capsys):
    argv = ["demo", "--tasks", "kv_recall", "--limit", "2", "--batch-size", "2", "--presets", "none", "--no-progress"]
    assert main(argv) == 0
    assert "DynamicCache" in capsys.readouterr().out
    assert status(clone, "--ignored") == ""  # not even in an ignored folder


def test_bench_writes_under_hfkv_out(clone, monkeypatch):
    monkeypatch.setattr(quiet, "load_average", lambda: 0.05)  # a quiet machine: no refusal, no settling wait
    argv = ["bench", "--model", "testbed", "--dtype", "fp32", "--device", "cpu", "--methods", "dynamic"]
    argv += ["--contexts", "16", "--decode-steps", "1", "--warmup", "0", "--threads", "1", "--no-progress"]
    assert main(argv) == 0
    assert status(clone) == ""
    written = sorted(p.relative_to(clone).as_posix() for p in (clone / "hfkv-out").rglob("*") if p.is_file())
    assert written == [f"hfkv-out/bench/testbed_fp32_cpu.{ext}" for ext in ("csv", "json", "png")]


def test_eval_example_writes_under_hfkv_out(clone):
    """The first example of ``hfkv eval --help`` / docs/lm-eval.md, at two examples of one task."""
    pytest.importorskip("lm_eval")
    argv = ["eval", "--model_args", "pretrained=testbed,hfkv_config=hfkv@80", "--include_path", "eval/tasks"]
    argv += ["--tasks", "testbed_kv_recall", "--batch_size", "2", "--limit", "2", "--device", "cpu"]
    argv += ["--output_path", "hfkv-out/eval"]
    assert main(argv) == 0
    assert status(clone) == ""
    (result,) = (clone / "hfkv-out" / "eval").rglob("results_*.json")
    assert json.loads(result.read_text())["config"]["hfkv"]["requests"] == 2


def test_the_documented_examples_name_no_committed_folder():
    """Every output path in hfkv eval's help and in docs/lm-eval.md is under hfkv-out/ (lm-eval writes only
    there); docs/bench.md's commands give no --out-dir, so they write to its default."""
    import re

    from hfkv.evaluation import bench, lm_eval_cli

    assert bench.DEFAULT_OUT == "hfkv-out/bench"
    texts = {"help": lm_eval_cli.__doc__ + lm_eval_cli.EPILOG, "lm-eval.md": (REPO / "docs/lm-eval.md").read_text()}
    for name, text in texts.items():
        paths = re.findall(r"--output_path\s+([^\s`-]\S*)", text)  # a value, not the option's name in prose
        assert paths, name
        assert all(p.startswith("hfkv-out/") for p in paths), (name, paths)
    assert "--out-dir" not in "".join(re.findall(r"```\n(.*?)```", (REPO / "docs/bench.md").read_text(), re.S))
