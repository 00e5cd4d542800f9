"""A run of an ``eval/`` script with its defaults writes into the user's folder (``hfkv-out/`` under the working
directory), never into the repository: the committed results under ``eval/results/`` are written only when named
(``--out eval/results/...``). Each script's parser is built and its output options' defaults read; nothing runs."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
USER_DIR = REPO / "hfkv-out"  # what a run from the repository root writes by default (gitignored)
# Scripts that write no result of their own: make_tables.py regenerates the committed markdown from the committed
# results (deterministic: a clean checkout stays clean).
NOT_RUNS = {"make_tables"}
# An output option whose default None means "write no file" (kernel_sass.py prints its rows without --out).
NO_FILE = {("kernel_sass", "out")}
OUT_DESTS = ("out", "out_dir", "output", "output_path", "output_dir")
# Each script by its path under eval/ without ".py" ("kernel_bench", "archive/interleave_probe"): the archived ones
# still run, so they too write nowhere in the repository by default.
SCRIPTS = sorted(
    p.relative_to(REPO / "eval").with_suffix("").as_posix()
    for folder in ("eval", "eval/archive")
    for p in (REPO / folder).glob("*.py")
    if p.stem not in NOT_RUNS and not p.stem.startswith("_")
)


class _Parser(BaseException):  # not an Exception: no handler of a script's catches it
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _load(name: str):
    """``eval/<name>.py`` as the module ``eval.<name>`` (``name`` may hold a folder: ``archive/interleave_probe``)."""
    return importlib.import_module("eval." + name.replace("/", "."))


def parser_of(name: str, monkeypatch) -> tuple[object, argparse.ArgumentParser]:
    """The script's parser: ``build_parser()`` where it has one, else the parser ``main`` builds, caught at its
    ``parse_args`` before anything runs."""
    module = _load(name)
    if hasattr(module, "build_parser"):
        return module, module.build_parser()

    def caught(self, args=None, namespace=None):
        raise _Parser(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", caught)
        m.setattr(sys, "argv", [f"eval/{name}.py"])
        try:
            module.main()
        except _Parser as got:
            return module, got.parser
    raise AssertionError(f"eval/{name}.py: main() returned without parsing its arguments")


def outputs(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.dest in OUT_DESTS]


def where(path) -> Path:
    """Where ``path`` lands for a run started in the repository root (the documented place to run from)."""
    p = Path(path)
    return (p if p.is_absolute() else REPO / p).resolve()


def in_repository_outside_user_dir(path) -> bool:
    p = where(path)
    return p.is_relative_to(REPO) and not p.is_relative_to(USER_DIR)


def test_the_scripts_are_found():
    assert {"sweep_testbed", "sweep_fidelity", "sweep_ruler", "host_overhead", "kernel_bench"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_default_output_is_outside_the_repository(name, monkeypatch):
    module, parser = parser_of(name, monkeypatch)
    acts = outputs(parser)
    if not acts:
        pytest.skip(f"eval/{name}.py has no output option")
    for act in acts:
        option = "/".join(act.option_strings)
        if act.required:
            continue  # the user names it
        default = act.default
        if default is None:
            if (name, act.dest) in NO_FILE:
                continue
            # computed from other options (--model): the script says where in out_path(args)
            assert hasattr(module, "out_path"), f"eval/{name}.py: {option} defaults to None and no out_path(args)"
            args = parser.parse_args([a for b in _required(parser) for a in b])
            default = module.out_path(args)
        assert not where(default).is_relative_to(REPO / "eval" / "results"), (
            f"eval/{name}.py: {option} defaults to {default}, inside the committed eval/results/"
        )
        assert not in_repository_outside_user_dir(default), (
            f"eval/{name}.py: {option} defaults to {default}, inside the repository outside hfkv-out/"
        )


def _required(parser: argparse.ArgumentParser) -> list[list[str]]:
    """A value for each required option, so that the defaults of the others can be parsed."""
    return [[a.option_strings[0], "x"] for a in parser._actions if a.required and a.option_strings]


def test_sweep_fidelity_extends_a_copy_of_the_committed_texts_not_the_file(tmp_path, monkeypatch):
    """Documents beyond those of the default (committed) texts file go to hfkv-out/eval/texts/, which starts with
    the committed file's documents; the committed file is untouched."""
    module = _load("sweep_fidelity")
    monkeypatch.chdir(tmp_path)
    docs = [{"id": 0, "ids": [1, 2, 3], "prompt_len": 2, "n_tokens": 3}]
    path = module.user_texts("eval/results/texts/smollm2.jsonl", docs)
    assert where(path) != where("eval/results/texts/smollm2.jsonl")
    assert Path(path) == Path("hfkv-out/eval/texts/smollm2.jsonl")
    from hfkv.evaluation.texts import load_documents

    assert [d["ids"] for d in load_documents(path)] == [[1, 2, 3]]
    assert module.user_texts("eval/results/texts/smollm2.jsonl", []) == path  # found again, not rewritten
    assert not (tmp_path / "eval").exists()


def test_format_fidelity_leaves_the_committed_page_alone_unless_writing_the_committed_results(monkeypatch):
    module = _load("format_fidelity")
    args = argparse.Namespace(out=None, model="smollm2")
    assert not where(module.out_path(args)).is_relative_to(module.RESULTS)
    args.out = "eval/results/formats_smollm2.json"
    assert where(module.out_path(args)).is_relative_to(module.RESULTS)
    assert module.DOCS == REPO / "docs" / "formats.md"  # the page and its inputs whatever the working directory


def test_the_texts_module_writes_into_the_users_folder_unless_named():
    """``python -m hfkv.evaluation.texts`` generates documents: by default under hfkv-out/, the committed file only
    when named (the sweeps still read the committed texts from ``DEFAULT_DIR``)."""
    from hfkv.evaluation import texts

    assert texts.out_path(None, "smollm2") == Path("hfkv-out/eval/texts/smollm2.jsonl")
    assert texts.out_path("eval/results/texts/smollm2.jsonl", "smollm2") == Path("eval/results/texts/smollm2.jsonl")
    assert texts.default_path("smollm2") == Path("eval/results/texts/smollm2.jsonl")
