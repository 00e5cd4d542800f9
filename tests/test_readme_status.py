"""README's Status table is a newcomer's minute: one short line per part, and each row links to the docs section
where its figures and commands live (issue 60: the table used to pack hundreds of words and dozens of figures into
single cells, naming result files but not the commands)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LINK = re.compile(r"\[[^\]]+\]\((?P<path>[^)#]+)\)(?P<rest>[^|\[]*)")
_SECTION = re.compile(r'"([^"]+)"')


def status_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("## Status", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[1:] if not set(row) <= set("|- ")]


def headings(path: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")}


def test_status_rows_are_short_and_point_at_sections_that_exist():
    rows = status_rows()
    assert len(rows) >= 5
    for part, state, where in rows:
        assert len(state.split()) <= 25, (part, state)  # a state in a line, not the figures
        links = list(_LINK.finditer(where))
        assert links, (part, where)
        for link in links:
            target = ROOT / link["path"]
            assert target.exists(), (part, link["path"])
            for section in _SECTION.findall(link["rest"].split(";")[0]):
                assert any(h.startswith(section) for h in headings(target)), (part, link["path"], section)
