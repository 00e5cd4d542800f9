"""Documented calibration commands write only under hfkv-out/ (issue 60: the smoke command of
calibration/README.md overwrote seven tracked files). Committed results under calibration/ and
configs/calibrated/ are written only by the blocks marked "# regenerates the committed results".

One test reads every command of the two calibration docs and checks where its outputs go (the CLI's own
parser, the scripts' own defaults); the other runs the documented smoke command at toy size (a tiny model,
two problems) in a fresh clone of the repository and checks that ``git status`` stays clean."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from hfkv.cli import build_parser, main
from tests.calibration_support import REPO, save_tiny

DOCS = ("calibration/README.md", "docs/calibration.md")
OUT = "hfkv-out"
REGENERATES = "# regenerates the committed results"  # marks a block allowed to write into the repository
STOP = {">", "2>&1", "&", "&&", "|", ";"}


def _blocks(doc: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (REPO / doc).read_text(encoding="utf-8"), re.S)


def _lines(block: str) -> list[list[str]]:
    """Each command line of a bash block as tokens (continuations joined, comments dropped, loop variable set)."""
    text = block.replace("\\\n", " ").replace("$g", "global")
    return [shlex.split(line, comments=True) for line in text.splitlines() if line.strip()]


def _redirects(tokens: list[str]) -> list[str]:
    return [tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t == ">"]


def _args_after(tokens: list[str], i: int) -> list[str]:
    out = []
    for t in tokens[i:]:
        if t in STOP:
            break
        out.append(t)
    return out


def _calibrate_outputs(args: list[str]) -> list[str]:
    """Where ``hfkv calibrate <args>`` writes: storage file, exports folder, config folder."""
    a = build_parser().parse_args(["calibrate", *args])
    name = a.study_name or "study"
    outputs = [a.studies_dir, a.output_dir or f"{a.studies_dir}/{name}", a.config_dir]
    storage = a.storage or f"sqlite:///{a.studies_dir}/{name}.db"
    if storage.startswith("journal:"):
        outputs.append(storage.removeprefix("journal:"))
    elif storage.startswith("sqlite:///"):
        outputs.append(storage.removeprefix("sqlite:///"))
    elif "://" not in storage and not storage.startswith("$") and Path(storage).suffix in (".journal", ".log"):
        outputs.append(storage)
    return outputs


def _script_outputs(script: str, args: list[str]) -> list[str]:
    if "--out" in args:
        return [args[args.index("--out") + 1]]
    source = (REPO / script).read_text(encoding="utf-8")
    found = re.search(r'^DEFAULT_OUT = Path\("([^"]+)"\)', source, re.M)
    assert found, f"{script}: no --out in the command and no DEFAULT_OUT"
    return [found.group(1)]


def _outputs(tokens: list[str]) -> list[str]:
    outputs = _redirects(tokens)
    for i, t in enumerate(tokens):
        if Path(t).name == "hfkv" and tokens[i + 1 : i + 2] == ["calibrate"]:
            outputs += _calibrate_outputs(_args_after(tokens, i + 2))
        elif t.startswith("calibration/") and t.endswith(".py"):
            outputs += _script_outputs(t, _args_after(tokens, i + 1))
    return outputs


def _inside_repository(path: str) -> bool:
    p = Path(path)
    return not p.is_absolute() or REPO in p.resolve().parents


def test_documented_commands_write_under_hfkv_out_unless_they_regenerate_committed_results():
    checked = 0
    for doc in DOCS:
        for block in _blocks(doc):
            regenerates = REGENERATES in block
            for tokens in _lines(block):
                for path in _outputs(tokens):
                    checked += 1
                    if regenerates or not _inside_repository(path):
                        continue
                    assert Path(path).parts[0] == OUT, f"{doc}: {' '.join(tokens)[:100]}... writes {path}"
    assert checked >= 20  # every recipe was read, not none


def _smoke_command() -> list[str]:
    text = (REPO / "calibration" / "README.md").read_text(encoding="utf-8")
    block = re.search(r"\*\*Smoke run\*\*.*?```bash\n(.*?)```", text, re.S).group(1)
    (tokens,) = _lines(block)
    i = next(i for i, t in enumerate(tokens) if Path(t).name == "hfkv")
    return _args_after(tokens, i + 1)


def _set(args: list[str], option: str, value: str) -> list[str]:
    assert option in args, f"the smoke command lost {option}"
    i = args.index(option)
    return [*args[: i + 1], value, *args[i + 2 :]]


def _git(clone: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(clone), *args], check=True, capture_output=True, text=True).stdout


@pytest.mark.slow
def test_the_smoke_command_leaves_a_fresh_clone_clean(tmp_path, monkeypatch):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and the repository's history")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--shared", str(REPO), str(clone)], check=True)
    if subprocess.run(["git", "-C", str(clone), "check-ignore", "-q", f"{OUT}/x"]).returncode != 0:
        with (clone / ".git" / "info" / "exclude").open("a") as fh:  # not .gitignore: that would dirty the tree
            fh.write(f"/{OUT}/\n")
    assert _git(clone, "status", "--porcelain") == ""

    # Toy size: the documented command with a tiny random model, 2 problems of 16 tokens and 1 held out.
    args = _smoke_command()
    study = args[args.index("--study-name") + 1]
    for option, value in (("--model", str(save_tiny(tmp_path / "model"))), ("--n-problems", "2"),
                          ("--holdout", "1"), ("--max-solution-tokens", "16")):  # fmt: skip
        args = _set(args, option, value)
    monkeypatch.chdir(clone)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(args) == 0
    finally:
        torch.set_num_threads(threads)

    assert _git(clone, "status", "--porcelain", "--untracked-files=all") == ""
    ignored = [line[3:] for line in _git(clone, "status", "--porcelain", "--ignored").splitlines()]
    assert all(p.startswith(f"{OUT}/") for p in ignored), ignored  # nothing even git-ignored beside the repo's files
    out = clone / OUT / "calibrate"
    for written in (f"studies/{study}.db", f"studies/{study}/summary.json", f"studies/{study}/holdout.json",
                    f"configs/{study}.yaml"):  # fmt: skip
        assert (out / written).is_file(), written  # the run wrote its results, in the user's folder
